"""The one walk over hook arguments (``trainmon.collect.modules.each_tensor``): which tensors a module's
inputs, kwargs and outputs hand to the forward rows and the gradient hooks, under which keys, and the
micro-step counter's walk into nested outputs."""

from __future__ import annotations

import torch

from trainmon.collect.modules import each_tensor


def _visits(values, nested=False):
    seen = []

    def visit(names, role, key, indexed, call, micro, tensor):
        seen.append((names, role, key, indexed, call, micro, int(tensor.item())))

    each_tensor(values, visit, "N", "output", 2, 5, nested=nested)
    return [(key, indexed, value) for names, role, key, indexed, call, micro, value in seen], seen


def t(x: float) -> torch.Tensor:
    return torch.tensor(x)


def test_a_tensor_a_tuple_a_list_and_a_dict():
    assert _visits(t(1))[0] == [(0, False, 1)]
    assert _visits((t(1),))[0] == [(0, False, 1)]  # one element: named like a single tensor
    # several elements: indexed by position, non-tensors skipped but counted
    assert _visits((t(1), None, t(3)))[0] == [(0, True, 1), (2, True, 3)]
    assert _visits([t(1), "x"])[0] == [(0, True, 1)]
    assert _visits({"a": t(1), "b": 2, "c": t(3)})[0] == [("a", True, 1), ("c", True, 3)]
    assert _visits({})[0] == [] and _visits(None)[0] == [] and _visits(3)[0] == []
    _, full = _visits(t(7))
    assert full == [("N", "output", 0, False, 2, 5, 7)]  # the context is handed on as it came


def test_nested_containers_are_walked_only_when_asked():
    output = (t(1), (t(2), [t(3)]), {"k": (t(4),)})
    assert _visits(output)[0] == [(0, True, 1)]
    assert [value for _, _, value in _visits(output, nested=True)[0]] == [1, 2, 3, 4]


def test_the_rows_and_hooks_of_a_monitored_module_follow_the_walk(tmp_path):
    import trainmon

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def forward(self, x, skip=None, extra=3):
            y = self.fc(x)
            return {"y": y, "both": y + skip, "n": 1}

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

        def forward(self, x):
            out = self.block(x, skip=x * 2)
            return out["y"].sum() + out["both"].sum()

    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainmon.attach(
        model, opt, config={"xy_distribution": True, "targets": ["block"], "format": "api"}, logdir=tmp_path
    ) as mon:
        model(torch.ones(3, 2, requires_grad=True)).backward()
        opt.step()
        names = sorted(mon.latest())
    # x positional (one tensor of one: not indexed), skip a kwarg (indexed by its key, extra not a tensor);
    # the dict output's tensors by their keys, n skipped
    assert names == [
        "actv/block.input",
        "actv/block.input_skip",
        "actv/block.output_both",
        "actv/block.output_y",
        "actv_grad/block.input_grad",
        "actv_grad/block.input_grad_skip",
        "actv_grad/block.output_grad_both",
        "actv_grad/block.output_grad_y",
    ]
