"""`tiny-gpt`: the corpus split, batches as pure functions, evaluation and the schedule (the 3-peer
swarm is in tests/peer/test_tiny_gpt_swarm.py)."""

import math

import pytest
import torch

from phalanx.errors import ConfigError
from phalanx.tasks import compute_gradient, resolve_task
from phalanx.tasks.text import file_corpus, stdlib_corpus

SMALL = {"dim": 32, "layers": 1, "heads": 2, "context": 32}


def test_the_standard_library_corpus_splits_by_file_and_is_the_same_every_time():
    train, valid = stdlib_corpus()
    assert len(train) > 1_000_000 and len(valid) > 50_000 and len(valid) < len(train) / 3
    assert stdlib_corpus() == (train, valid)
    assert b"def " in valid and b"import " in train


def test_a_data_file_splits_at_a_line_break_and_a_short_one_is_refused(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"".join(b"line %d of a small corpus\n" % i for i in range(500)))
    train, valid = file_corpus(text)
    assert train + valid == text.read_bytes() and train.endswith(b"\n") and 0.08 < len(valid) / len(train) < 0.13
    task = resolve_task("tiny-gpt", data_file=text, **SMALL)
    assert bytes(task.test_inputs.numpy()) == valid
    (tmp_path / "short.txt").write_bytes(b"too short\n" * 10)
    with pytest.raises(
        ConfigError, match=r"^--data-file: its validation part has \d+ bytes, fewer than two windows of 33"
    ):
        resolve_task("tiny-gpt", data_file=tmp_path / "short.txt", **SMALL)
    with pytest.raises(ConfigError, match="cannot read it"):
        resolve_task("tiny-gpt", data_file=tmp_path / "missing.txt", **SMALL)


def test_batches_are_windows_shifted_by_one_byte_and_a_pure_function_of_seed_peer_and_step():
    task = resolve_task("tiny-gpt", **SMALL)
    x, y = task.batch(0, "peer", 7, 4)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(task.batch(0, "peer", 7, 4)[0], x) and not torch.equal(task.batch(0, "peer", 8, 4)[0], x)
    loss, grad = compute_gradient(task, task.build_model(0), 0, "peer", 7, 4)
    again = compute_gradient(task, task.build_model(0), 0, "peer", 7, 4)
    assert loss == again[0] and torch.equal(grad, again[1])


def test_an_untrained_model_is_near_uniform_and_training_lowers_validation_loss():
    task = resolve_task("tiny-gpt", **SMALL)
    model = task.build_model(0)
    first = task.evaluate(model)
    assert abs(first["loss"] - math.log(256)) < 0.2 and first["perplexity"] == pytest.approx(math.exp(first["loss"]))
    optimizer = task.make_optimizer(model.parameters())
    assert isinstance(optimizer, torch.optim.AdamW)
    for step in range(40):
        compute_gradient(task, model, 0, "p", step, 32)
        optimizer.step()
    assert task.evaluate(model)["loss"] < first["loss"] - 1.0


def test_the_schedule_warms_up_linearly_then_decays_by_cosine_to_a_tenth():
    task = resolve_task("tiny-gpt", **SMALL)
    assert task.lr_factor(0) == pytest.approx(1 / task.warmup_steps)
    assert task.lr_factor(task.warmup_steps - 1) == pytest.approx(1.0)
    assert task.lr_factor(task.warmup_steps + task.decay_steps // 2) == pytest.approx(0.55)
    assert task.lr_factor(task.warmup_steps + task.decay_steps * 3) == pytest.approx(0.1)


def test_heads_must_divide_the_width():
    with pytest.raises(ConfigError, match=r"--task-options dim=30 must be a multiple of heads=4"):
        resolve_task("tiny-gpt", dim=30, heads=4)
