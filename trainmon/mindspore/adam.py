"""Adam-family state of MindSpore optimizers: where the moments live and Adam's update and ratio.

``nn.AdamWeightDecay`` and ``nn.Lamb`` keep the moments in ``moments1``/``moments2``, ``nn.Adam`` in
``moment1``/``moment2``. ``update = m_hat / (sqrt(v_hat) + eps)`` and ``ratio = m_hat / sqrt(v_hat)`` with
``m_hat = m / c1`` and ``v_hat = v / c2`` (msprobe's ``ur_distribution``): ``nn.Adam`` corrects the bias with
``c = 1 - beta_power`` (its ``beta1_power``/``beta2_power`` hold ``beta^t`` after the update);
``nn.AdamWeightDecay`` applies no bias correction (``c = 1``). Both tensors are computed by one compiled
graph on the moments' device, from device values (no host read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mindspore as ms
from mindspore import nn, ops

_F32 = ms.float32


def moments(optimizer: nn.Cell) -> tuple[Sequence[ms.Tensor], Sequence[ms.Tensor]] | None:
    """The first and second moment tuples, in the order of ``optimizer.parameters``; None without them."""
    for first, second in (("moments1", "moments2"), ("moment1", "moment2")):
        m, v = getattr(optimizer, first, None), getattr(optimizer, second, None)
        if m is not None and v is not None:
            return m, v
    return None


@dataclass(frozen=True)
class BiasCorrection:
    """What Adam's update divides the moments by: ``1 - beta1_power``/``1 - beta2_power`` or 1, and eps."""

    powers: tuple[ms.Tensor, ms.Tensor]  # (beta1^t, beta2^t) as device values; zeros: no correction
    eps: float

    @classmethod
    def of(cls, optimizer: nn.Cell) -> BiasCorrection | None:
        """The correction of a known Adam variant; None for others (Lamb, custom optimizers)."""
        eps = getattr(optimizer, "eps", None)
        if eps is None:
            return None
        eps = float(eps.asnumpy().reshape(-1)[0]) if isinstance(eps, ms.Tensor) else float(eps)
        if isinstance(optimizer, nn.AdamWeightDecay):
            return cls((ms.Tensor(0.0, _F32), ms.Tensor(0.0, _F32)), eps)
        p1, p2 = getattr(optimizer, "beta1_power", None), getattr(optimizer, "beta2_power", None)
        if isinstance(optimizer, nn.Adam) and p1 is not None and p2 is not None:
            return cls((p1, p2), eps)
        return None

    def update_and_ratio(self, m: ms.Tensor, v: ms.Tensor) -> tuple[ms.Tensor, ms.Tensor]:
        # Parameters as plain tensors: a compiled graph would be compiled again for each Parameter
        p1, p2 = (ops.stop_gradient(p) for p in self.powers)
        return _compiled_update_and_ratio(ops.stop_gradient(m), ops.stop_gradient(v), p1, p2, self.eps)


def _update_and_ratio(m: ms.Tensor, v: ms.Tensor, p1: ms.Tensor, p2: ms.Tensor, eps: float):
    m_hat = m.astype(_F32) / (1.0 - p1.astype(_F32).reshape(()))
    root = ops.sqrt(v.astype(_F32) / (1.0 - p2.astype(_F32).reshape(())))
    return m_hat / (root + eps), m_hat / root


_compiled_update_and_ratio = ms.jit(_update_and_ratio)
