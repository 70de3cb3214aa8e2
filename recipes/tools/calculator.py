"""The calculator the quickstart-tools model calls: ordinary Python functions, whose signatures
and docstrings become the chat template's tools."""


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def mul(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b
