"""Configuration: the recipe sections (sections.py), their validation (validate.py) and recipes (recipe.py)."""
