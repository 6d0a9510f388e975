"""Tuning knobs of a kernel: its defaults with the caller's in their place."""


def with_defaults(defaults: dict, given: dict, kernel: str) -> dict:
    """`defaults` with the `given` knobs that are not None in their place; TypeError for a knob it does not know."""
    unknown = set(given) - set(defaults)
    if unknown:
        raise TypeError(f"unknown {kernel} knobs {sorted(unknown)}; the kernel takes {sorted(defaults)}")
    return defaults | {name: value for name, value in given.items() if value is not None}
