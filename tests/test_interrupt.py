"""train.interrupt: what a Ctrl-C (SIGINT) or SIGTERM does in and around a run's steps."""

import signal

import pytest

from train.interrupt import InterruptHandler, uninterrupted


@pytest.fixture
def default_sigint():
  """Python's own SIGINT handler for the test (an xdist worker may have another)."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


def test_outside_the_steps_a_ctrl_c_stops_at_once_and_again_at_a_safe_point(default_sigint):
  with InterruptHandler() as ctrl_c:
    with pytest.raises(KeyboardInterrupt):
      signal.raise_signal(signal.SIGINT)
    assert ctrl_c.requested
    with pytest.raises(KeyboardInterrupt):  # where a finalizer swallowed it
      ctrl_c.check()
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.fixture
def default_sigterm():
  """Python's own SIGTERM disposition for the test."""
  previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
  yield
  signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("signum,shown", [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")])
def test_in_the_steps_the_first_signal_asks_and_the_second_stops(signum, shown, default_sigint,
                                                                 default_sigterm, capsys):
  """SIGTERM (kill, docker, SLURM preemption) as Ctrl-C: it killed the run at once,
  everything since the last periodic checkpoint lost."""
  default = signal.getsignal(signum)
  with InterruptHandler() as ctrl_c:
    ctrl_c.in_steps = True
    signal.raise_signal(signum)  # no exception: the loop saves, then stops
    assert ctrl_c.requested
    assert (f"interrupt ({shown}): saving after this step, then stopping"
            in capsys.readouterr().err)
    with pytest.raises(KeyboardInterrupt):
      signal.raise_signal(signum)
  assert signal.getsignal(signum) is default  # put back
  with InterruptHandler(), pytest.raises(KeyboardInterrupt):
    signal.raise_signal(signum)  # outside the steps: stops at once


def test_a_caller_s_own_handler_and_a_disabled_one_are_left_alone(default_sigint):
  seen = []
  mine = lambda signum, frame: seen.append(signum)  # noqa: E731
  signal.signal(signal.SIGINT, mine)
  with InterruptHandler() as ctrl_c:
    ctrl_c.in_steps = True
    signal.raise_signal(signal.SIGINT)
  assert seen == [signal.SIGINT] and not ctrl_c.requested
  assert signal.getsignal(signal.SIGINT) is mine
  signal.signal(signal.SIGINT, signal.default_int_handler)
  with InterruptHandler(enabled=False) as ctrl_c:
    ctrl_c.in_steps = True
    with pytest.raises(KeyboardInterrupt):
      signal.raise_signal(signal.SIGINT)
  assert not ctrl_c.requested


def test_a_stop_during_a_checkpoint_write_waits_for_its_end(default_sigint, capsys):
  """A second Ctrl-C while orbax wrote a checkpoint raised inside its save: its commit
  thread failed at exit (a traceback) and the step was left half-written."""
  done = []
  with InterruptHandler() as ctrl_c:
    ctrl_c.in_steps = True
    signal.raise_signal(signal.SIGINT)  # the first: save after the step
    with pytest.raises(KeyboardInterrupt):
      with uninterrupted():
        signal.raise_signal(signal.SIGINT)  # the second, mid-write: held
        done.append("written")
    assert done == ["written"]
    assert "stopping once the checkpoint being written is complete" in capsys.readouterr().err
    with uninterrupted():  # nothing pending after it
      pass
    with pytest.raises(KeyboardInterrupt):  # outside a write: at once, as before
      signal.raise_signal(signal.SIGINT)
