"""The one exception type lowconv raises for a user's mistake (its message is the whole story),
and an error put in one line."""


class LowconvError(Exception):
    """A problem with the user's input (model, recipe, checkpoint) that they can fix.

    The message names the file, the key or the module and, where there are some, the valid choices.
    """


def first_line(err: BaseException) -> str:
    """"TypeName: the first line of the message": an error in one line."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".strip()
