"""Defaults that follow the device: link kinds per mesh axis and the precision a plan is made in."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.mesh import default_links, mesh_spec


@pytest.mark.parametrize("shape, links", [
    ((8, 8), ("ib", "nvlink")), ((4, 2), ("nvlink", "nvlink")), ((2, 16), ("ib", "ib")),
    ((2, 2, 2), ("nvlink", "nvlink", "nvlink")), ((4, 4, 2), ("ib", "nvlink", "nvlink")), ((64,), ("ib",)),
    ((8,), ("nvlink",)), ((16, 1), ("ib", "nvlink")),
])
def test_gpu_axes_within_a_node_are_nvlink_the_rest_infiniband(shape, links):
    assert default_links(["a"] * len(shape), shape, "cuda") == links


def test_cpu_meshes_talk_over_loopback():
    assert default_links(("dp", "tp"), (2, 2), "cpu") == ("loopback", "loopback")


def test_fake_mesh_takes_its_device_from_the_config():
    mesh = autopar.fake_mesh((2, 2), ("dp", "tp"))  # a GPU mesh unless the config says otherwise
    assert mesh_spec(mesh).links == ("nvlink", "nvlink") and mesh_spec(mesh).device_type == "cuda"
    cpu = mesh_spec(mesh, device="cpu")
    assert cpu.links == ("loopback", "loopback") and cpu.device_type == "cpu"
    assert mesh_spec(autopar.fake_mesh(4, "dp", "cpu"), device="h100").device_type == "cuda"


def test_fake_mesh_with_a_cpu_config_plans_in_fp32_like_a_real_cpu_mesh():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def loss_fn(out, x):
        return out.pow(2).mean()

    config = autopar.Config(device="cpu", solver=autopar.SolverConfig(show_progress=False))
    p = autopar.plan(model, autopar.fake_mesh((2, 2), ("dp", "tp")), (torch.randn(8, 16),), loss_fn=loss_fn,
                     config=config)
    assert p.mixed_precision == "fp32" and p.mesh.links == ("loopback", "loopback") and p.device == "cpu"
    assert "fp32" in p.summary()
