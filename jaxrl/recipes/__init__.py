"""Recipes: one module per recipe, each with `get_config()` returning a ConfigDict."""
