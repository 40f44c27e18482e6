"""engine/redo_tuning.py: the device-redone layers chosen from the run's own step times, and the choice's exactness
on the simulated device (a device redo is the host's, bit for bit, whichever count runs)."""
from __future__ import annotations

import copy

import torch

import offload_ext
from helpers import batches, flat_tensors, offloaded_training, tiny_llama
from offload_ext.engine.redo_tuning import SAMPLES, WARMUP, RedoTuning

CANDIDATES = ((2, frozenset({4, 5})), (3, frozenset({3, 4, 5})), (1, frozenset({5})), (0, frozenset()))


def _feed(tuning: RedoTuning, intervals: list[int], redoing: bool = True) -> None:
    # whole numbers of (say) milliseconds: their sums are exact, so the samples are the intervals given
    now = 0
    tuning.observe(now, redoing)
    for dt in intervals:
        now += dt
        tuning.observe(now, redoing)


def test_each_candidate_is_timed_in_turn_after_the_warm_up_and_the_least_time_is_kept() -> None:
    tuning = RedoTuning(CANDIDATES)
    assert tuning.layers == 2 and tuning.units == {4, 5}  # the planned count until measured
    # the warm-up's steps (opening no interval), then SAMPLES intervals per candidate in the given order
    per_count = {2: [300, 210, 250], 3: [200, 220, 230], 1: [240, 240, 240], 0: [500, 400, 450]}
    _feed(tuning, [9000] * WARMUP + [t for k, _ in CANDIDATES for t in per_count[k]])
    assert tuning.times == per_count
    assert tuning.chosen == 3 and tuning.layers == 3 and tuning.units == {3, 4, 5}
    assert tuning.summary().startswith("3 layers a stack") and "0: 400.000 s" in tuning.summary()
    assert tuning.news() == tuning.summary() and tuning.news() is None  # the choice told once


def test_a_pause_between_steps_does_not_decide_and_steps_that_commit_open_no_interval() -> None:
    tuning = RedoTuning(CANDIDATES[:2])
    _feed(tuning, [1000] * (WARMUP - 1))  # the warm-up's redone steps
    now = 100_000
    for _ in range(5):  # committed steps (no redo): they only close an interval a redone step opened
        now += 100
        tuning.observe(now, redoing=False)
    assert tuning.times == {}
    tuning.observe(now, redoing=True)  # the first timed step opens its interval
    # a redone step's interval, then a checkpoint's pause, ...: each candidate's least time stands
    for dt in [200, 30_000, 210, 300, 310, 320]:
        now += dt
        tuning.observe(now, redoing=True)
    assert tuning.times == {2: [200, 30_000, 210], 3: [300, 310, 320]} and tuning.chosen == 2


def test_one_candidate_stands_without_measuring() -> None:
    tuning = RedoTuning(((4, frozenset({7, 8})),))
    _feed(tuning, [100] * 10)
    assert tuning.chosen == 4 and tuning.times == {} and tuning.units == {7, 8}
    assert tuning.news() is None  # nothing measured: nothing to tell


def test_the_run_measures_each_count_on_the_device_and_stays_the_hosts_bit_for_bit() -> None:
    # Every step clips (max_grad_norm far under the norm): the redone steps try a third, half, a sixth and none of
    # the six layers in turn, then keep one; whichever ran, parameters and state are the host-only run's.
    base, data = tiny_llama(layers=6), batches(WARMUP + 4 * SAMPLES + 3)

    def run(**kw) -> tuple[RedoTuning, dict, list[float], list[torch.Tensor]]:
        model = copy.deepcopy(base)
        off = offload_ext.Offloader(model, lr=1e-3, backend="native", device="cpu", max_grad_norm=1e-3, **kw)
        losses = offloaded_training(off, model, data)
        assert off.last_clip_action == "redone"
        state, stats, tuning = flat_tensors(off.state_dict()), off.stats(), off.redo_tuning
        off.close()  # the model then holds every layer's weights (a streamed one's are the host's)
        return tuning, stats, losses, [*model.parameters(), *state]

    tuning, stats, tuned_losses, tuned_values = run()
    assert tuning.chosen in (2, 3, 1, 0) and sorted(tuning.times) == [0, 1, 2, 3]
    assert all(len(t) == SAMPLES for t in tuning.times.values())
    assert stats["device_redo_layers"] == tuning.chosen and stats["device_redo_chosen"]
    assert stats["device_redo_times_s"] == {k: min(t) for k, t in tuning.times.items()}
    measured = stats["device_redo_times_s"]
    assert min(measured, key=lambda k: (measured[k], k)) == tuning.chosen
    # the redos the device ran: those of every timed count's samples, then the chosen count's for the rest
    counted = WARMUP * 2 + SAMPLES * (2 + 3 + 1 + 0) + (len(data) - WARMUP - 4 * SAMPLES) * tuning.chosen
    assert stats["device_redos"] == counted
    host_tuning, host_stats, host_losses, host_values = run(device_redo_layers=0)
    assert host_tuning.chosen == 0 and host_stats["device_redos"] == 0
    assert tuned_losses == host_losses
    assert all(torch.equal(a, b) for a, b in zip(tuned_values, host_values, strict=True))


def test_counts_past_the_streamed_layers_collapse_into_one_candidate() -> None:
    # Five of six layers resident: a third, half and a sixth of the stack all name its one streamed layer.
    off = offload_ext.Offloader(tiny_llama(layers=6), backend="native", device="cpu", max_grad_norm=1.0,
                                resident_layers=5)
    assert off.redo_tuning.candidates == ((1, frozenset({0})), (0, frozenset()))
    off.close()
    asked = offload_ext.Offloader(tiny_llama(layers=6), backend="native", device="cpu", max_grad_norm=1.0,
                                  device_redo_layers=2)
    assert asked.redo_tuning.candidates == ((2, frozenset({4, 5})),) and asked.redo_tuning.chosen == 2
    asked.close()


def test_eight_bit_moments_also_measure_two_thirds_of_the_stack_on_the_device() -> None:
    # an 8-bit redo copies half of bf16's bytes in and out, and the host's pass is the slower
    off = offload_ext.Offloader(tiny_llama(layers=6), backend="native", device="cpu", max_grad_norm=1.0,
                                precision="bf16-8bit")
    assert [layers for layers, _ in off.redo_tuning.candidates] == [2, 3, 4, 1, 0]
    assert off.redo_tuning.candidates[2][1] == {2, 3, 4, 5}
    off.close()
