"""Collectives on host tensors never go through a NCCL group: they use the host group
(the default group under gloo, a gloo group under NCCL)."""

import ast
import os
from datetime import timedelta

import torch.distributed as dist

from megatron.pipeline import host_group as host_group_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIVES = {"all_reduce", "all_gather_object", "all_gather", "broadcast", "barrier",
               "send", "recv", "isend", "irecv", "reduce_scatter", "gather", "scatter"}
# Point-to-point of device tensors (activations, gradients, checkpoints) uses the default
# group on purpose: NCCL on GPUs.
DEVICE_TENSOR_MODULES = {os.path.join("megatron", "pipeline", "p2p.py")}


def test_every_collective_outside_p2p_names_its_group():
    missing = []
    for folder, _, files in os.walk(os.path.join(ROOT, "megatron")):
        for name in files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT)
            if not name.endswith(".py") or rel in DEVICE_TENSOR_MODULES:
                continue
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"
                        and node.func.attr in COLLECTIVES
                        and not any(k.arg == "group" for k in node.keywords)):
                    missing.append(f"{rel}:{node.lineno} dist.{node.func.attr}")
    assert missing == [], missing


def test_under_nccl_host_collectives_get_a_gloo_group(monkeypatch):
    """... with the job's collective timeout (torch would give a new group 30 minutes)."""
    created = []
    monkeypatch.setattr(dist, "get_backend", lambda *args: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda **kw: created.append(kw) or "gloo-group")
    monkeypatch.setattr(host_group_module, "_timeout", None)
    host_group_module.set_group_timeout(timedelta(minutes=3))
    host_group_module.forget_host_group()
    try:
        assert host_group_module.host_group() == "gloo-group"
        assert host_group_module.host_group() == "gloo-group"  # created once
        assert created == [{"ranks": None, "backend": "gloo", "timeout": timedelta(minutes=3)}]
    finally:
        host_group_module.forget_host_group()


def test_under_gloo_the_default_group_serves(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda *args: "gloo")
    assert host_group_module.host_group() is None
