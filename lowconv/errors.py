"""The one exception type lowconv raises for a user's mistake: its message is the whole story."""


class LowconvError(Exception):
    """A problem with the user's input (model, recipe, checkpoint) that they can fix.

    The message names the file, the key or the module and, where there are some, the valid choices.
    """
