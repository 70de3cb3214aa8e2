"""Packages are found, not listed (the rest of the build is declared in pyproject.toml).

Every package under mlxtune/ is found by walking the folder. Three folders stay at the top of the
repository and are installed inside mlxtune: tui/ as mlxtune.tui, metal_kernels/ as
mlxtune.metal_kernels, recipes/ as mlxtune.recipes (with their files, pyproject's package-data).
tests/test_packaging.py holds a built wheel against the tree.
"""

from setuptools import find_namespace_packages, find_packages, setup

MAPPED = {
    "mlxtune.tui": "tui",
    "mlxtune.metal_kernels": "metal_kernels",
    "mlxtune.recipes": "recipes",
}


def packages() -> list[str]:
    found = find_packages(include=["mlxtune", "mlxtune.*"])
    for name, folder in MAPPED.items():
        # recipes/ holds folders of data, not code: setuptools wants each listed as a package
        find = find_namespace_packages if folder == "recipes" else find_packages
        found += [name, *(f"{name}.{sub}" for sub in find(folder, exclude=["*__pycache__*"]))]
    return found


setup(packages=packages(), package_dir=MAPPED)
