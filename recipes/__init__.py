"""The shipped recipes, installed as ``mlxtune.recipes``: ``mlxtune init`` copies one, with the
data and models it names, into a folder of the user's (mlxtune/shipped.py)."""
