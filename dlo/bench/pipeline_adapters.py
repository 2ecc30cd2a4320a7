"""LoRA adapters switched per request on a pipeline folder under a device budget (issue 36's
adapter target): ``python -m dlo.bench.pipeline_adapters DIR --budget 24 --size 1024x1024
--steps 4 --rank 64 --adapters 3 --requests 10``.

``--adapters`` random LoRAs (rank ``--rank`` on the DiT blocks' ``--targets`` layers, bf16,
in host memory as a loaded file would be) serve ``--requests`` requests in turn, three ways:

- ``resident``: diffusers' pipeline with every weight on the device (the reference bits);
- ``dlo-load``: ``OffloadConfig(device_budget_gb=B)``; each request loads its adapter with
  ``load_lora_weights`` while dlo streams ([Note: adapters while streaming]), then deletes the
  previous one: the switch is the load;
- ``dlo-switch``: every adapter loaded once after enable (kept on the device), each request
  a ``set_adapters``;
- ``dlo-streamed``: every adapter loaded before enable, so each is part of its block and
  streams with it (every forward moves every adapter's bytes: compare its step with
  ``dlo-none``'s); each request a ``set_adapters``;
- ``dlo-none``: the same budget with no adapter: the step an adapter costs nothing on.

``preload_ms`` is the one-time load of ``dlo-switch``'s adapters (while enabled) and of
``dlo-streamed``'s (before enable).

Per request: the switch's ms (device synchronized), the steady step, and the output bit for
bit against resident's for the same request. The target: a switch within the adapter's bytes
over the pinned H2D rate measured here, plus 20 ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from dlo.backends.factory import enable_offload
from dlo.bench.budgets import one_budget
from dlo.bench.flags import add_call_arguments, method_list
from dlo.bench.methods import _clean
from dlo.bench.pipeline_budgets import Bench, _capped, bench_main, failure, same, save
from dlo.commands.pipeline_calls import dits_of, resident_reference
from dlo.config.fields import GIB
from dlo.config.offload import OffloadConfig
from dlo.runtime.measure import GB, h2d_bandwidth

METHODS = ("resident", "dlo-load", "dlo-switch", "dlo-streamed", "dlo-none")
TARGET_SLACK_MS = 20.0
"""Issue 36: a switch within the adapter's bytes over the H2D rate plus this."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dlo.bench.pipeline_adapters")
    p.add_argument("pipeline", help="the diffusers pipeline folder")
    p.add_argument("--budget", required=True, help="the device budget (GiB) of dlo's rows")
    p.add_argument("--rank", type=int, default=64, help="LoRA rank")
    p.add_argument("--adapters", type=int, default=3, help="how many adapters")
    p.add_argument("--requests", type=int, default=10, help="requests, each on one adapter")
    p.add_argument(
        "--targets",
        default="to_q,to_k,to_v,to_out.0",
        help="the block layers each adapter reaches (name suffixes), comma-separated",
    )
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    add_call_arguments(p)
    return p.parse_args(argv)


def lora_state_dicts(pipe: Any, args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """``--adapters`` random LoRAs in diffusers' key format for the pipeline's first DiT."""
    targets = tuple(t for t in args.targets.split(",") if t)
    dit = dits_of(pipe)[0]
    layers = [
        (name, m)
        for name, m in dit.named_modules()
        if isinstance(m, torch.nn.Linear) and name.endswith(targets) and ".lora_" not in name
    ]
    if not layers:
        raise ValueError(f"--targets={args.targets!r}: no linear layer of the DiT ends so")
    out = []
    for i in range(args.adapters):
        g = torch.Generator().manual_seed(1000 + i)
        sd = {}
        for name, m in layers:
            a = torch.randn(args.rank, m.in_features, generator=g) / m.in_features**0.5
            b = torch.randn(m.out_features, args.rank, generator=g) * 1e-2
            sd[f"transformer.{name}.lora_A.weight"] = a.to(torch.bfloat16)
            sd[f"transformer.{name}.lora_B.weight"] = b.to(torch.bfloat16)
        out.append(sd)
    return out


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


class Requests:
    """The request sequence, run the same way on every method."""

    def __init__(self, b: Bench, args: argparse.Namespace, loras: list[dict[str, Any]]) -> None:
        self.b, self.args, self.loras = b, args, loras
        self.expect: dict[int, dict[str, Any]] = {}

    def serve(self, method: str, pipe: Any, switch: Any) -> list[dict[str, Any]]:
        """Each request: ``switch(pipe, request, adapter)`` timed, then the call."""
        rows = []
        for r in range(self.args.requests):
            a = r % len(self.loras)
            self.b.platform.synchronize()
            t0 = time.perf_counter()
            switch(pipe, r, a)
            self.b.platform.synchronize()
            switch_ms = (time.perf_counter() - t0) * 1e3
            out, times = self.b.call(pipe, 0, reset=method == "resident")
            if method == "resident":
                self.expect[r] = out
            ref = self.expect.get(r)
            rows.append(
                {
                    "method": method,
                    "request": r,
                    "adapter": f"a{a}",
                    "switch_ms": switch_ms,
                    "step_ms_median": times["step_ms_median"],
                    "hbm_peak_nbytes": times["hbm_peak_nbytes"],
                    "bitwise_vs_resident": None if ref is None else same(out, ref),
                }
            )
        return rows


def _load_one(pipe: Any, r: int, a: int, loras: list[dict[str, Any]]) -> None:
    """Load request ``r``'s adapter, then drop the previous request's."""
    pipe.load_lora_weights(dict(loras[a]), adapter_name=f"r{r}")
    pipe.set_adapters([f"r{r}"])
    if r > 0:
        pipe.delete_adapters(f"r{r - 1}")


def _set(pipe: Any, r: int, a: int) -> None:
    pipe.set_adapters([f"a{a}"])


def _timed(b: Bench, fn: Any, *args: Any) -> float:
    """Seconds of ``fn(*args)``, the device synchronized at both ends."""
    b.platform.synchronize()
    t0 = time.perf_counter()
    fn(*args)
    b.platform.synchronize()
    return time.perf_counter() - t0


def _load_all(pipe: Any, loras: list[dict[str, Any]]) -> None:
    for i, sd in enumerate(loras):
        pipe.load_lora_weights(dict(sd), adapter_name=f"a{i}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    budget = one_budget(args.budget)
    for flag in ("rank", "adapters", "requests"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag}={getattr(args, flag)!r}: expected a positive integer")
    methods = method_list(args.methods, METHODS)
    if "resident" not in methods:  # every row is compared with its outputs
        raise ValueError(f"--methods={args.methods!r}: resident and any of {list(METHODS[1:])}")
    b = Bench(args)
    h2d = h2d_bandwidth(b.platform, 256 << 20, pinned=True)
    ref = resident_reference(args.pipeline, b.dtype, b.device)
    loras = lora_state_dicts(ref, args)
    serve = Requests(b, args, loras)
    rows = serve.serve("resident", ref, lambda p, r, a: _load_one(p, r, a, loras))
    del ref
    _clean(b.platform)

    def report() -> dict[str, Any]:
        return {
            "pipeline": args.pipeline,
            "device": str(b.device),
            "size": b.size_name(0),
            "steps": b.steps[0],
            "budget_gb": budget,
            "rank": args.rank,
            "adapter_nbytes": nbytes(loras[0]),
            "h2d_pinned_GBps": h2d / GB,
            "results": rows,
        }

    for method in methods:
        if method == "resident":
            continue
        save(args.json, report())
        pipe = resident_reference(args.pipeline, b.dtype, torch.device("cpu"))
        preload_s = 0.0
        if method == "dlo-streamed":  # before enable: each adapter is part of its block
            preload_s = _timed(b, _load_all, pipe, loras)
        ok, undo = _capped(b.platform, budget)
        backend = None
        try:
            backend = enable_offload(pipe, OffloadConfig(device_budget_gb=budget), device=b.device)
            assert backend is not None  # a layer config always has one
            if method == "dlo-switch":
                preload_s = _timed(b, _load_all, pipe, loras)
            switch = {
                "dlo-load": lambda p, r, a: _load_one(p, r, a, loras),
                "dlo-none": lambda p, r, a: None,
            }.get(method, _set)
            new = serve.serve(method, pipe, switch)
            st = backend.stats()
            for row in new:
                row.update(capped=ok, host_nbytes=st["host_nbytes"], preload_ms=preload_s * 1e3)
                if method == "dlo-none":
                    row["bitwise_vs_resident"] = None  # resident served adapters
        except (torch.OutOfMemoryError, ValueError, RuntimeError) as e:
            new = [{"method": method, "failed": failure(e)}]
        finally:
            if backend is not None:
                backend.disable()
            undo()
            del pipe
            _clean(b.platform)
        rows += new
    save(args.json, report())
    return report()


def markdown(report: dict[str, Any]) -> str:
    """Per method: switch ms (median, max), steady step, bitwise; against the target."""
    target = report["adapter_nbytes"] / (report["h2d_pinned_GBps"] * GB) * 1e3 + TARGET_SLACK_MS
    lines = [
        f"Adapter: rank {report['rank']}, {report['adapter_nbytes'] / 2**20:.1f} MiB; pinned H2D "
        f"{report['h2d_pinned_GBps']:.1f} GB/s; target switch <= {target:.1f} ms; budget "
        f"{report['budget_gb']:g} GiB; {report['size']} x {report['steps']} steps.",
        "",
        "| method | requests | switch ms median | switch ms max (first excluded) | preload ms | "
        "steady step ms median | peak HBM GiB | bitwise |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by: dict[str, list[dict[str, Any]]] = {}
    for r in report["results"]:
        by.setdefault(r["method"], []).append(r)
    for method, rows in by.items():
        if "failed" in rows[0]:
            lines.append(f"| {method} | {rows[0]['failed']} |" + " |" * 6)
            continue
        sw = [r["switch_ms"] for r in rows]
        later = sw[1:] or sw
        lines.append(
            f"| {method} | {len(rows)} | {statistics.median(sw):.1f} | {max(later):.1f} | "
            f"{rows[0].get('preload_ms', 0.0):.1f} | "
            f"{statistics.median(r['step_ms_median'] for r in rows):.1f} | "
            f"{max(r['hbm_peak_nbytes'] for r in rows) / GIB:.2f} | "
            f"{all(r['bitwise_vs_resident'] is not False for r in rows)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse, run, markdown)


if __name__ == "__main__":
    sys.exit(main())
