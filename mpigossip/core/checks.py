"""Argument checks shared by every layer (no MPI, no arrays): one wording for one mistake."""

import numbers


def integer_error(value, name, minimum=None, maximum=None, allow_none=False):
    """The problem with an integer argument, or None. Booleans are not integers here;
    numpy integers are."""
    if allow_none and value is None:
        return None
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return None
    if minimum is not None and maximum is not None:
        want = f"an integer in [{minimum}, {maximum}]"
    elif minimum is not None:
        want = f"an integer >= {minimum}"
    else:
        want = "an integer"
    return f"{name} must be {want}{' or None' if allow_none else ''}, got {value!r}"


def check_integer(value, name, minimum=None, maximum=None, allow_none=False, owner=None):
    """``value`` if it is a valid integer argument, else ``ValueError`` (prefixed ``owner: ``)."""
    error = integer_error(value, name, minimum, maximum, allow_none)
    if error:
        raise ValueError(f"{owner}: {error}" if owner else error)
    return value
