"""Errors that name what the user must fix."""


class RecipeError(ValueError):
    """Bad input: a recipe value, a data file or a data row. The message is one line that names the
    field, file or row and what to do; the CLI prints it without a traceback."""
