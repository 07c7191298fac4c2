"""Does a stored checkpoint tree fit a restore target? Compared before orbax reads any array, so a changed model
(another number of experts, hidden size or layer count; another kind of checkpoint) is one line naming the first
differing path, not an orbax traceback.

Both trees are flattened to `"a/b/0/c" -> (shape, dtype)`: the stored side from orbax's tree metadata (nested dicts
and lists), the target side from its pytree key paths (dataclass attributes, dict keys, sequence indices), so a
`TrainState` and the dict orbax recorded for it give the same paths.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from dgemma.checkpoint.errors import CheckpointMismatchError

MAX_PATH = 160
"""Characters of one parameter path quoted in a message (paths of nested optimizer states get long)."""
MAX_MESSAGE = 900
"""Characters of a whole mismatch message: a tree of another kind must not become a 100 kB line."""


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def flat_leaves(tree: Any) -> dict[str, tuple[tuple[int, ...] | None, np.dtype | None]]:
    """`path -> (shape, dtype)` of every leaf (None where a leaf has no shape / dtype, e.g. a Python scalar)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        out["/".join(_key_name(k) for k in path)] = (
            tuple(int(d) for d in shape) if shape is not None else None,
            np.dtype(dtype) if dtype is not None else None)
    return out


def _cut(text: str, limit: int = MAX_PATH) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(entry: tuple) -> str:
    shape, dtype = entry
    return f"{shape if shape is not None else '?'} {dtype if dtype is not None else ''}".strip()


def first_difference(stored: dict, target: dict, *, check_dtypes: bool) -> str | None:
    """One phrase naming the first differing path (target order, then stored order) and how many differ; None if the
    trees fit."""
    missing = [p for p in target if p not in stored]  # dict membership: O(1) per path
    unexpected = [p for p in stored if p not in target]

    def differs(p: str) -> bool:
        (s_shape, s_dtype), (t_shape, t_dtype) = stored[p], target[p]
        if s_shape is not None and t_shape is not None and s_shape != t_shape:
            return True
        return check_dtypes and s_dtype is not None and t_dtype is not None and s_dtype != t_dtype

    changed = [p for p in target if p in stored and differs(p)]
    if not (missing or unexpected or changed):
        return None
    bad = {*missing, *unexpected, *changed}
    first = next(p for p in [*target, *unexpected] if p in bad)
    if first in set(changed):
        what = (f"'{_cut(first)}' is {_describe(stored[first])} in the checkpoint but {_describe(target[first])} in "
                f"the model being restored")
    elif first in set(missing):
        what = f"'{_cut(first)}' is in the model being restored but not in the checkpoint"
    else:
        what = f"'{_cut(first)}' is in the checkpoint but not in the model being restored"
    counts = [f"{n} {label}" for n, label in ((len(changed), "of another shape/dtype"),
                                               (len(missing), "missing from the checkpoint"),
                                               (len(unexpected), "not in the model")) if n]
    return f"{what} ({', '.join(counts)}; {len(stored)} arrays stored, {len(target)} expected)"


def check_fits(stored_tree: Any, target: Any, *, what: str, hint: str, check_dtypes: bool = True) -> None:
    """Raise CheckpointMismatchError (one line, at most MAX_MESSAGE characters) unless `stored_tree` (orbax tree
    metadata) has exactly the paths of `target` with the same shapes (and dtypes with `check_dtypes`).

    Args:
      what: names the checkpoint, e.g. "checkpoint step 6 in /runs/a/checkpoints".
      hint: what the user can do about it.
    """
    difference = first_difference(flat_leaves(stored_tree), flat_leaves(target), check_dtypes=check_dtypes)
    if difference is None:
        return
    message = f"{what} does not fit: {difference}"
    room = MAX_MESSAGE - len(hint) - 2
    if len(message) > room:
        message = message[: room - 3] + "..."
    raise CheckpointMismatchError(f"{message}; {hint}")
