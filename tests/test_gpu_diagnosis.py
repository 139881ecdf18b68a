"""A GPU that CUDA cannot use is said so, in doctor and in the engine choice, and `auto` does
not quietly put the job on the CPU. The facts are made up (CudaFacts), as a machine with a
GPU and a too-old driver would report them; runtime.engines.nvidia.diagnose judges them."""

import pytest

from runtime.commands.doctor import report
from runtime.engines.hardware import choose_engine, probe
from runtime.engines.nvidia import CudaFacts, diagnose
from runtime.base.errors import SpillpackError

CUDA_WHEEL = dict(torch_version="2.13.0+cu128", torch_cuda="12.8")


def facts(**kw) -> CudaFacts:
    return CudaFacts(**{**CUDA_WHEEL, **kw})


def test_no_gpu_at_all_is_a_plain_no():
    d = diagnose(facts())
    assert not d.usable and not d.gpu_unusable and d.detail == "no CUDA device is visible"
    assert diagnose(facts(torch_cuda=None)).detail == "this torch has no CUDA support"
    assert diagnose(CudaFacts()).detail == "torch is not installed"


def test_nvidia_smi_without_a_gpu_is_not_a_gpu_machine():
    d = diagnose(facts(smi="/usr/bin/nvidia-smi", smi_error="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"))
    assert not d.usable and not d.gpu_unusable
    assert "couldn't communicate" in d.detail


def test_driver_too_old_for_the_wheel():
    d = diagnose(facts(device_nodes=["/dev/nvidia0"], gpus=["Tesla T4"], driver="470.182.03", smi="/usr/bin/nvidia-smi",
                       init_error="The NVIDIA driver on your system is too old (found version 11040)."))
    assert not d.usable and d.gpu_unusable
    assert "Tesla T4" in d.detail and "470.182.03" in d.detail and "CUDA 12.8" in d.detail and ">= 525.60.13" in d.detail
    assert "525.60.13" in d.fix and "--engine torch-cpu" in d.fix


def test_new_enough_driver_that_still_fails_gives_cudas_reason():
    d = diagnose(facts(device_nodes=["/dev/nvidia0"], driver="550.54.15",
                       init_error="CUDA driver initialization failed, you might not have a CUDA gpu."))
    assert d.gpu_unusable and "CUDA driver initialization failed" in d.detail and "container" in d.fix


def test_cpu_only_torch_on_a_gpu_machine():
    d = diagnose(facts(torch_cuda=None, device_nodes=["/dev/nvidia0", "/dev/nvidia1"]))
    assert d.gpu_unusable and "CPU-only build" in d.detail and "/dev/nvidia0" in d.detail


def test_a_working_gpu():
    d = diagnose(facts(available=True, device_name="NVIDIA H100 80GB HBM3", device_nodes=["/dev/nvidia0"]))
    assert d.usable and "NVIDIA H100" in d.detail
    assert probe("torch-cuda", facts(available=True, device_name="NVIDIA L4")).usable


BROKEN = dict(device_nodes=["/dev/nvidia0"], gpus=["NVIDIA A10G"], driver="470.57.02", smi="/usr/bin/nvidia-smi")


def test_auto_refuses_the_cpu_of_a_gpu_machine(monkeypatch):
    monkeypatch.delenv("SPILLPACK_ENGINE", raising=False)
    with pytest.raises(SpillpackError) as e:
        choose_engine("auto", facts(**BROKEN))
    line = e.value.line()
    assert line.startswith("spillpack: this machine has an NVIDIA GPU (NVIDIA A10G, driver 470.57.02)")
    assert "does not fall back to the CPU" in line and "Try: update the NVIDIA driver" in line and "\n" not in line
    # Asked for by name, the CPU runs it, and the placement says why the GPU was not used.
    engine, why = choose_engine("torch-cpu", facts(**BROKEN))
    assert engine == "torch-cpu" and "asked for by --engine" in why and "driver is older" in why
    monkeypatch.setenv("SPILLPACK_ENGINE", "torch-cpu")
    assert choose_engine("auto", facts(**BROKEN))[0] == "torch-cpu"
    # Asking for torch-cuda says the same cause.
    monkeypatch.delenv("SPILLPACK_ENGINE")
    with pytest.raises(SpillpackError, match="driver is older than torch 2.13.0.cu128's CUDA 12.8 needs"):
        choose_engine("torch-cuda", facts(**BROKEN))


def test_auto_on_a_machine_without_gpu_still_uses_the_cpu(monkeypatch):
    monkeypatch.delenv("SPILLPACK_ENGINE", raising=False)
    engine, why = choose_engine("auto", facts())
    assert engine == "torch-cpu" and why == "no Apple silicon or CUDA device"


def test_doctor_names_the_cause_and_the_fix(home):
    r = report("auto", measure_rates=False, cuda=facts(**BROKEN))
    cuda = r["engines"]["torch-cuda"]
    assert not cuda["usable"] and "driver is older" in cuda["detail"] and "525.60.13" in cuda["fix"]
    assert r["engine"] is None and "does not fall back to the CPU" in r["engine_reason"]
    r = report("torch-cpu", measure_rates=False, cuda=facts(**BROKEN))
    assert r["engine"] == "torch-cpu" and "driver is older" in r["engine_reason"]
