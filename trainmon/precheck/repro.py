"""One captured call kept as a safetensors file (its tensors, and its arguments' structure as JSON in the
file's metadata), and a standalone script that re-runs it from that file (torch and safetensors only, no
trainmon): the training's own outputs and a re-run on the machine at hand, each against the call re-run
upcast on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from trainmon.precheck.capture import CapturedCall
from trainmon.precheck.transport import call_message, decode_call


def save_call(call: CapturedCall, path: str | Path) -> Path:
    message, tensors = call_message(call)
    path = Path(path)
    save_file(
        {f"t{i}": t.detach().cpu().contiguous() for i, t in enumerate(tensors)},
        str(path),
        {"call": json.dumps(message)},
    )
    return path


def load_call(path: str | Path) -> CapturedCall:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        message = json.loads(handle.metadata()["call"])
    loaded = load_file(str(path))
    return decode_call(message, [loaded[f"t{i}"] for i in range(len(loaded))])


_SCRIPT = '''"""Re-run {name} ({module}) from {data}: written by trainmon precheck.

    python {script} [--device cuda]
"""
import argparse
import json

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

DATA = {data!r}
UP = {{torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}}


def unpack(value, tensors, move):
    if isinstance(value, list):
        return [unpack(v, tensors, move) for v in value]
    if isinstance(value, dict):
        if "$t" in value:
            return move(tensors[value["$t"]])
        if "$dtype" in value:
            return getattr(torch, value["$dtype"])
        if "$slice" in value:
            return slice(*value["$slice"])
        if "$ellipsis" in value:
            return Ellipsis
        if "$tuple" in value:
            return tuple(unpack(v, tensors, move) for v in value["$tuple"])
        return {{k: unpack(v, tensors, move) for k, v in value.items()}}
    return value


def api(name):
    owner, _, short = name.rpartition(".")
    return getattr({{"Tensor": torch.Tensor, "torch.nn.functional": F, "torch": torch}}[owner], short)


def metrics(out, golden):
    a, b = out.double().cpu().reshape(-1), golden.double().cpu().reshape(-1)
    cosine = float(a @ b / (a.norm() * b.norm())) if a.norm() and b.norm() else float(torch.equal(a, b))
    rel = (a - b).abs() / (b.abs() + torch.finfo(out.dtype).eps)
    worst, relative = float((a - b).abs().max()), float(rel.max())
    return "cosine {{:.6f}}  max abs err {{:.3e}}  max rel err {{:.3e}}".format(cosine, worst, relative)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    device = parser.parse_args().device
    with safe_open(DATA, "pt") as handle:
        call = json.loads(handle.metadata()["call"])
    loaded = load_file(DATA)
    tensors = [loaded["t" + str(i)] for i in range(len(loaded))]
    fn = api(call["api"])
    here = lambda t: t.to(device)
    upcast = lambda t: t.to("cpu", UP.get(t.dtype, t.dtype))
    args, kwargs = call["args"]["$tuple"], call["kwargs"]
    with torch.no_grad():
        rerun = fn(*unpack(args, tensors, here), **unpack(kwargs, tensors, here))
        golden = fn(*unpack(args, tensors, upcast), **unpack(kwargs, tensors, upcast))
    rerun = rerun if isinstance(rerun, (tuple, list)) else (rerun,)
    golden = golden if isinstance(golden, (tuple, list)) else (golden,)
    outputs = unpack(call["outputs"]["$tuple"], tensors, lambda t: t)
    print(call["name"], "in", call["module"] or "(top)")
    for i, (trained, again, ref) in enumerate(zip(outputs, rerun, golden)):
        print("output", i, "as trained:", metrics(trained, ref))
        print("output", i, "re-run on", device + ":", metrics(again, ref))


if __name__ == "__main__":
    main()
'''


def write_script(data: str | Path, script: str | Path) -> Path:
    """A standalone script re-running the call kept in ``data`` (see :func:`save_call`)."""
    call = load_call(data)
    script = Path(script)
    text = _SCRIPT.format(
        name=call.name, module=call.module or "(top)", data=str(Path(data).resolve()), script=script.name
    )
    script.write_text(text)
    return script
