"""Hardware specs (configs/hardware) and the step-time / memory predictor built on them."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import yaml

from optimizer.hardware import HardwareSpecError, find_hardware, load_all, load_spec_file
from optimizer.predict import (ACHIEVABLE_FRACTION, DEFAULT_INTER_NODE_GBS, KERNELS_PER_LAYER, REFERENCE_WORKLOAD,
                               Workload, memory_gib_needed, predict_step_seconds, step_seconds_many)
from providers.catalog import load_offers

REQUIRED = ("H100-SXM", "H200", "A100-80GB", "L4", "A10G", "MI300X", "cpu-generic")


def test_shipped_specs_cover_the_required_chips_and_every_catalog_accelerator():
    specs = load_all()
    assert set(REQUIRED) <= set(specs)
    for offer in load_offers():
        assert find_hardware(offer.accelerator) is not None, f"no spec for {offer.accelerator}"


def test_shipped_specs_are_internally_consistent():
    for spec in load_all().values():
        assert spec.main_memory.bandwidth_gbs < spec.memory[0].bandwidth_gbs   # main memory is the slowest level
        if spec.kind == "gpu" and "bf16" in spec.peak_tflops:
            assert spec.peak_tflops["bf16"] >= spec.peak_tflops["fp32"]


def test_vendor_figures_of_two_chips():
    h100, h200 = find_hardware("H100"), find_hardware("h200")
    assert (h100.name, h100.peak_tflops["bf16"], h100.main_memory.bandwidth_gbs) == ("H100-SXM", 989.4, 3350)
    assert (h200.compute_units, h200.main_memory.bandwidth_gbs, h200.main_memory.size_mib) == (132, 4800, 144384)
    assert find_hardware("A100").name == "A100-40GB" and find_hardware("a100-80gb").name == "A100-80GB"
    assert find_hardware(None).kind == "cpu" and find_hardware("K80") is None


def test_a_chip_without_the_dtype_runs_it_at_the_fp32_rate():
    t4 = find_hardware("T4")
    assert t4.peak_flops("bf16") == t4.peak_flops("fp32") == 8.1e12
    assert t4.peak_flops("fp16") == 65e12


GOOD = {"name": "X1", "aliases": ["x1"], "kind": "gpu", "vendor": "v", "peak_tflops": {"fp32": 1.0},
        "clock_ghz": 1.0, "compute_units": 2, "simd_width": 32, "registers_per_unit_kib": 1,
        "shared_memory_per_unit_kib": 1, "launch_overhead_us": 1, "interconnect_gbs": 1,
        "memory": [{"name": "hbm", "size_mib": 10, "bandwidth_gbs": 10}],
        "shared_memory_per_block_kib": 1, "threads_per_unit": 2048, "blocks_per_unit": 32, "registers_per_thread": 255}


@pytest.mark.parametrize("change, message", [
    ({"peak_tflops": {"fp32": -1}}, "peak_tflops.fp32: -1 must be a number > 0"),
    ({"peak_tflops": {"fp32": 1, "fp7": 2}}, "peak_tflops.fp7: unknown dtype"),
    ({"kind": "tpu"}, "kind: 'tpu' is not one of gpu, cpu"),
    ({"memory": [{"name": "hbm", "size_mib": 1}]}, "memory[0]: must be {name"),
    ({"clock_ghz": "fast"}, "clock_ghz: 'fast' must be a number"),
    ({"colour": "red"}, "unknown field 'colour'"),
    ({"memory": [{"name": "hbm", "size_mib": 1, "bandwidth_gbs": 1, "core_bandwidth_gbs": 0}]},
     "memory[0].core_bandwidth_gbs: 0 must be a number > 0"),
    ({"memory": [{"name": "hbm", "size_mib": 1, "bandwidth_gbs": 1, "ports": 2}]}, "memory[0]: must be {name"),
    ({"call_overhead_us": "slow"}, "call_overhead_us: 'slow' must be a number > 0"),
    ({"threads": 1.5}, "threads: 1.5 must be a whole number >= 1"),
    ({"threads": 0}, "threads: 0 must be a whole number >= 1"),
    ({"cpu_model": 7}, "cpu_model: must be a string"),
    ({"core_peak_tflops": 0}, "core_peak_tflops: 0 must be a number > 0"),
    ({"library_gemm_efficiency": 85}, "library_gemm_efficiency: 85.0 is a fraction of the FMA peak"),
    ({"library_gemm_efficiency": 0}, "library_gemm_efficiency: 0 must be a number > 0"),
    ({"shared_memory_per_block_kib": None}, "shared_memory_per_block_kib: None must be a number > 0"),
    ({"shared_memory_per_block_kib": 2}, "shared_memory_per_block_kib: 2 is more than shared_memory_per_unit_kib"),
    ({"registers_per_thread": 25.5}, "registers_per_thread: 25.5 must be a whole number >= 1"),
    ({"threads_per_unit": 0}, "threads_per_unit: 0 must be a whole number >= 1"),
    ({"kind": "cpu"}, "shared_memory_per_block_kib: only GPU specs have launch limits"),
])
def test_a_bad_spec_names_its_file_and_field(tmp_path, change, message):
    (tmp_path / "x1.yaml").write_text(yaml.safe_dump({**GOOD, **change}))
    with pytest.raises(HardwareSpecError) as err:
        load_spec_file(tmp_path / "x1.yaml")
    assert str(err.value).startswith("x1.yaml: ") and message in str(err.value)


def test_the_optional_calibration_fields_load_and_default(tmp_path):
    measured = {**GOOD, "call_overhead_us": 3.5, "cpu_model": "Some CPU", "threads": 4, "library_gemm_efficiency": 0.6,
                "memory": [{"name": "l1", "size_mib": 0.1, "bandwidth_gbs": 800, "core_bandwidth_gbs": 200},
                           {"name": "dram", "size_mib": 1024, "bandwidth_gbs": 40}]}
    (tmp_path / "x1.yaml").write_text(yaml.safe_dump(measured))
    spec = load_spec_file(tmp_path / "x1.yaml")
    assert (spec.call_overhead_us, spec.cpu_model, spec.threads, spec.library_gemm_efficiency) == \
        (3.5, "Some CPU", 4, 0.6)
    assert [m.core_bandwidth_gbs for m in spec.memory] == [200.0, None]
    generic = find_hardware("cpu")
    assert (generic.call_overhead_us, generic.cpu_model, generic.threads, generic.library_gemm_efficiency) == \
        (2.0, "", 0, 0.85)
    assert all(m.core_bandwidth_gbs is None for m in find_hardware("H100").memory)


def test_a_core_runs_at_its_calibrated_peak_else_the_chip_s_share(tmp_path):
    (tmp_path / "x1.yaml").write_text(yaml.safe_dump({**GOOD, "core_peak_tflops": 0.8}))
    calibrated = load_spec_file(tmp_path / "x1.yaml")
    assert calibrated.core_peak_flops() == pytest.approx(0.8e12)   # above peak / cores (0.5): a core alone
    assert calibrated.threads_peak_flops("fp32", 1) == pytest.approx(0.8e12)
    assert calibrated.threads_peak_flops("fp32", 2) == calibrated.threads_peak_flops("fp32", None) == 1e12
    uncalibrated = dataclasses.replace(calibrated, core_peak_tflops=0.0)
    assert uncalibrated.core_peak_flops() == uncalibrated.threads_peak_flops("fp32", 1) == 0.5e12
    t4 = find_hardware("T4")
    assert t4.core_peak_flops("fp16") / t4.core_peak_flops("fp32") == pytest.approx(65 / 8.1)


def test_a_gpu_spec_without_its_launch_limits_is_refused(tmp_path):
    data = {k: v for k, v in GOOD.items() if k != "blocks_per_unit"}
    (tmp_path / "x1.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(HardwareSpecError, match="x1.yaml: blocks_per_unit: required field of a GPU spec is missing"):
        load_spec_file(tmp_path / "x1.yaml")
    assert find_hardware("H100").shared_memory_per_block_kib == 227 and find_hardware("T4").threads_per_unit == 1024


def test_a_missing_field_and_a_duplicate_alias_are_refused(tmp_path):
    data = dict(GOOD)
    del data["interconnect_gbs"]
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(HardwareSpecError, match="interconnect_gbs: required field is missing"):
        load_all(str(tmp_path))
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(GOOD))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({**GOOD, "name": "X2", "aliases": ["X1"]}))
    with pytest.raises(HardwareSpecError, match="alias 'X1' is already used by X1"):
        load_all(str(tmp_path))


SMALL = Workload(params=1.0e8, layers=12, hidden=768, seq_len=1024, batch_size=64, dtype="bf16")


def test_flops_are_six_n_per_token_plus_attention():
    tokens = 64 * 1024
    assert SMALL.flops_per_step == pytest.approx(tokens * 6 * 1.0e8 + tokens * 12 * 12 * 1024 * 768)


def test_memory_needed_is_adam_state_plus_one_sequence_of_activations():
    # 16 bytes of state per parameter, 34 bytes per token, layer and hidden unit in bf16, 1 GiB overhead
    expected = (16 * 1.0e8 + 34 * 12 * 768 * 1024) / 2**30 + 1.0
    assert memory_gib_needed(SMALL) == pytest.approx(expected)
    fp32 = Workload(params=1.0e8, layers=12, hidden=768, seq_len=1024, batch_size=64, dtype="fp32")
    assert memory_gib_needed(fp32) == pytest.approx((16 * 1.0e8 + 68 * 12 * 768 * 1024) / 2**30 + 1.0)


def test_a_compute_bound_step_is_flops_over_sustained_peak_plus_all_reduce_and_launches():
    h100 = find_hardware("H100")
    step = predict_step_seconds(REFERENCE_WORKLOAD, h100, 8)
    compute = REFERENCE_WORKLOAD.flops_per_step / (8 * 989.4e12 * ACHIEVABLE_FRACTION["gpu"])
    all_reduce = 2 * 7 / 8 * (1.3e9 * 2) / 450e9
    launches = 24 * KERNELS_PER_LAYER * 4e-6
    assert step == pytest.approx(compute + all_reduce + launches)


def test_a_memory_bound_step_is_bounded_by_main_memory_bandwidth():
    # a huge model with one short sequence per step: far more bytes than FLOPs per byte of the chip
    w = Workload(params=5e9, layers=2, hidden=64, seq_len=1, batch_size=1, dtype="bf16")
    l4 = find_hardware("L4")
    step = predict_step_seconds(w, l4, 1)
    traffic = 5e9 * (4 * 2 + 2 * 12) + 2 * 34 * 2 * 64 * 1
    assert step == pytest.approx(traffic / 300e9 + 2 * KERNELS_PER_LAYER * 4e-6)
    assert step > w.flops_per_step / (l4.peak_flops("bf16") * ACHIEVABLE_FRACTION["gpu"])


def test_more_nodes_add_the_inter_node_all_reduce_and_share_the_compute():
    a100 = find_hardware("A100")
    one = predict_step_seconds(REFERENCE_WORKLOAD, a100, 8, nodes=1)
    two = predict_step_seconds(REFERENCE_WORKLOAD, a100, 8, nodes=2)
    fast_net = predict_step_seconds(REFERENCE_WORKLOAD, a100, 8, nodes=2, inter_node_gbs=400.0)
    compute_one = REFERENCE_WORKLOAD.flops_per_step / (8 * 312e12 * 0.45)
    inter = 2 * 1 / 2 * 1.3e9 * 2 / (DEFAULT_INTER_NODE_GBS * 1e9)
    assert two == pytest.approx(one - compute_one / 2 + inter)
    assert fast_net < two


def test_the_vectorized_prediction_matches_one_at_a_time():
    chips = [find_hardware(n) for n in ("H100", "A10G", "T4", None, "MI300X")]
    counts = np.array([8, 4, 1, 0, 8])
    many = step_seconds_many(SMALL, chips, counts, 3, np.array([12.5, 50, 12.5, 1, 400]))
    one = [predict_step_seconds(SMALL, c, int(k), 3, net) for c, k, net in zip(chips, counts, [12.5, 50, 12.5, 1, 400])]
    assert np.allclose(many, one) and all(math.isfinite(x) and x > 0 for x in one)


def test_a_bad_workload_is_refused():
    with pytest.raises(ValueError, match="dtype 'int8'"):
        Workload(params=1, layers=1, hidden=1, seq_len=1, batch_size=1, dtype="int8")
    with pytest.raises(ValueError, match="layers must be a number > 0"):
        Workload(params=1, layers=0, hidden=1, seq_len=1, batch_size=1)
