"""The torch/Lightning seam (lightning_swarm.torch_ext): its private names still exist in the installed releases and
still behave as the wrappers assume; an unsupported release warns."""

import warnings

import pytest
import torch

from lightning_swarm import torch_ext
from lightning_swarm.scheduler import rebind_scheduler

IMPORTABLE = [name for name in torch_ext.PRIVATE_NAMES if name.attribute is None]


@pytest.mark.parametrize("private", IMPORTABLE, ids=lambda private: private.path)
def test_each_importable_private_name_exists(private):
    assert torch_ext._resolve(private.path) is not None


def test_a_name_that_moved_is_reported(monkeypatch):
    moved = torch_ext.PrivateName("torch.cpu._no_such_probe", "")
    monkeypatch.setattr(torch_ext, "PRIVATE_NAMES", torch_ext.PRIVATE_NAMES + (moved,))
    assert torch_ext.missing_private_names() == ["torch.cpu._no_such_probe"]
    assert torch_ext.cpu_probe("torch.cpu._no_such_probe") is False  # absent feature, not a crash


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)


def test_torch_marks_a_scheduled_optimizer_as_mark_step_tracking_does():
    """mark_step_tracking imitates what LRScheduler does to an optimizer: the same two attributes."""
    by_torch = _optimizer()
    torch.optim.lr_scheduler.StepLR(by_torch, step_size=1)
    by_torch.step()
    by_us = _optimizer()
    torch_ext.mark_step_tracking(by_us)
    by_us.step()
    for optimizer in (by_torch, by_us):
        assert getattr(optimizer.step, "_wrapped_by_lr_sched", False) is True
        assert getattr(optimizer, "_opt_called", False) is True


@pytest.mark.parametrize("composite", ["sequential", "chained"])
def test_a_composite_scheduler_is_rebound_child_by_child_without_torch_warnings(composite):
    old = _optimizer()
    children = [torch.optim.lr_scheduler.ExponentialLR(old, gamma=0.5),
                torch.optim.lr_scheduler.ExponentialLR(old, gamma=1.0)]
    if composite == "sequential":
        scheduler = torch.optim.lr_scheduler.SequentialLR(old, children, milestones=[2])
    else:
        scheduler = torch.optim.lr_scheduler.ChainedScheduler(children)
    assert len(torch_ext.child_schedulers(scheduler)) == 2
    new = torch.optim.SGD(old.param_groups, lr=1.0)
    rebound = rebind_scheduler(scheduler, new)
    assert all(child.optimizer is new for child in torch_ext.child_schedulers(rebound))
    assert all(child.optimizer is old for child in torch_ext.child_schedulers(scheduler))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        new.step()
        rebound.step()
    assert new.param_groups[0]["lr"] == pytest.approx(0.5)


def test_releases_outside_the_checked_ranges_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch_ext.check_versions({"torch": "2.5.1+cpu", "lightning": "2.4.0"}) == []
    with pytest.warns(RuntimeWarning, match="torch"):
        assert torch_ext.check_versions({"torch": "3.0.0", "lightning": "2.5.0"}) == ["torch"]


def test_one_optimizer_and_at_most_one_scheduler_are_required():
    class TwoOptimizers(torch.nn.Module):
        def configure_optimizers(self):
            return [_optimizer(), _optimizer()]

    with pytest.raises(ValueError, match="exactly one optimizer"):
        torch_ext.configure_single_optimizer(TwoOptimizers())

    class OneWithSchedule(torch.nn.Module):
        def configure_optimizers(self):
            optimizer = _optimizer()
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}

    optimizer, scheduler = torch_ext.configure_single_optimizer(OneWithSchedule())
    assert isinstance(optimizer, torch.optim.SGD) and isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
