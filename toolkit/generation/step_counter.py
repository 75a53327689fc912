"""Counting a decoding step's host work: operators and host-device synchronizations.

Why: a cached step of a large model on a GPU is bound by the host, not by the GPU: each
operator costs a kernel launch and each read of a device value on the host (``.item()``,
``bool()``, ``.tolist()``, ``.cpu()``, ``nonzero``, boolean-mask indexing, ``torch.equal``)
waits for every queued kernel, so the host cannot queue the next step while the GPU runs.
On a CPU those reads are free and invisible in a timing, so they are counted here instead:
``benchmarks/generate.py --profile-step`` reports them per step, tests bound them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten operators whose result the host reads (on a GPU: after every queued kernel ran)
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default", "aten.is_nonzero.default"}
# indexing by a boolean mask runs nonzero inside the kernel (the mask's count sizes the result)
INDEX_OPS = {"aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default"}


def _masked_index(name: str, args) -> bool:
    return name in INDEX_OPS and any(i is not None and i.dtype == torch.bool for i in args[1])


class StepCounter(TorchDispatchMode):
    """Within ``with StepCounter(model) as c:``, ``c.model_ops`` / ``c.search_ops`` count the operators
    run inside / outside ``model``'s forward and ``c.syncs`` the host reads of device values.

    ``.tolist()`` and ``.cpu()`` do not reach the dispatcher on a CPU tensor (on a GPU they copy
    to the host), so they are counted by wrapping the two methods while the counter is on.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None):
        super().__init__()
        self.model_ops = self.search_ops = self.syncs = 0
        self.in_model = False
        self.hooks = (
            []
            if model is None
            else [
                model.register_forward_pre_hook(lambda *_: self._set(True)),
                model.register_forward_hook(lambda *_: self._set(False)),
            ]
        )
        self.methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu")}

    def _set(self, value: bool) -> None:
        self.in_model = value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.in_model:
            self.model_ops += 1
        else:
            self.search_ops += 1
        name = str(func)
        self.syncs += name in SYNC_OPS or _masked_index(name, args)
        return func(*args, **(kwargs or {}))

    def _counting(self, method):
        def call(tensor, *args, **kwargs):
            self.syncs += 1
            return method(tensor, *args, **kwargs)

        return call

    def __enter__(self):
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, self._counting(method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, method)
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)
