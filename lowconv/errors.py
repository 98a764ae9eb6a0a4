"""The one exception type lowconv raises for a user's mistake (its message is the whole story), the
warning lowconv.convert gives for each of its plan's warnings, and an error put in one line."""


class LowconvError(Exception):
    """A problem with the user's input (model, recipe, checkpoint) that they can fix.

    The message names the file, the key or the module and, where there are some, the valid choices.
    """


class ModelRunError(LowconvError):
    """The user's model raised when run on its own example inputs; the CLI names the model's file."""


class LowconvWarning(UserWarning):
    """What a conversion changed beside the sites (Plan.warnings), as lowconv.convert warns of it."""


def first_line(err: BaseException) -> str:
    """"TypeName: the first line of the message": an error in one line."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".strip()
