"""The preemption handler with real signals sent to this process."""

import os
import signal
import time

import pytest

from runtime.base.signals import Abandon, Preemption


@pytest.fixture
def pre():
    p = Preemption(promise_s=3.0, reserve_s=1.0).install()
    yield p
    p.uninstall()


def busy(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_step_that_fits_is_finished(pre):
    pre.expected_step_s = 0.2
    with pre.abandonable():
        os.kill(os.getpid(), signal.SIGTERM)
        busy(0.3)
    assert pre.stop_requested and pre.signal_name == "SIGTERM"


def test_step_too_long_for_the_promise_is_abandoned_at_once(pre):
    pre.expected_step_s = 60.0
    t0 = time.monotonic()
    with pytest.raises(Abandon):
        with pre.abandonable():
            os.kill(os.getpid(), signal.SIGTERM)
            busy(5)
    assert time.monotonic() - t0 < 1.5


def test_step_that_overruns_its_estimate_is_abandoned_by_the_alarm(pre):
    pre.expected_step_s = 0.1  # it claims to be short, then runs on
    t0 = time.monotonic()
    with pytest.raises(Abandon):
        with pre.abandonable():
            os.kill(os.getpid(), signal.SIGTERM)
            busy(10)
    # promise 3 s minus the 1 s reserve for the commit
    assert time.monotonic() - t0 < 2.5


def test_second_signal_abandons_at_once(pre):
    pre.expected_step_s = 0.5
    with pytest.raises(Abandon):
        with pre.abandonable():
            os.kill(os.getpid(), signal.SIGINT)
            busy(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
            busy(5)
    assert pre.signal_name == "SIGINT" and pre.count == 2


def test_outside_a_step_a_signal_only_asks(pre):
    os.kill(os.getpid(), signal.SIGTERM)
    busy(0.05)
    assert pre.stop_requested
    with pytest.raises(Abandon):
        with pre.setup():  # a pending request abandons loading at once
            busy(1)


def test_setup_abandons_when_the_signal_comes_during_loading(pre):
    with pytest.raises(Abandon):
        with pre.setup():
            os.kill(os.getpid(), signal.SIGTERM)
            busy(5)


def test_a_stop_inside_an_import_abandons_once_the_import_is_over(pre, tmp_path, monkeypatch):
    """A module body may run under a C extension's initializer (torch imports its Python parts
    through pybind11), where an exception cannot unwind: the stop waits for the import's end."""
    (tmp_path / "slow_module_for_signals.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "end = time.monotonic() + 0.3\n"
        "while time.monotonic() < end:\n"
        "    pass\n"
        "FINISHED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pre.start_up()
    finished = None
    with pytest.raises(Abandon):
        import slow_module_for_signals

        finished = slow_module_for_signals.FINISHED
        busy(5)  # the deferred stop lands here, a few milliseconds after the import
    assert finished is True and pre.stop_requested


def test_a_stop_outside_an_import_during_start_up_abandons_at_once(pre):
    pre.start_up()
    t0 = time.monotonic()
    with pytest.raises(Abandon):
        os.kill(os.getpid(), signal.SIGTERM)
        busy(5)
    assert time.monotonic() - t0 < 1.0


def test_once_the_stop_is_taken_no_pending_alarm_abandons_the_telling_of_it(pre):
    """A stop inside an import arms a recheck alarm; if the start-up's own check raises first, the
    alarm must not raise Abandon again while the CLI tells the preemption (a traceback, not 75)."""
    pre.start_up()
    with pytest.raises(Abandon):
        os.kill(os.getpid(), signal.SIGTERM)
        busy(5)
    signal.setitimer(signal.ITIMER_REAL, 0.01)  # as _abandon arms it inside an import
    pre.stand_down()
    try:
        busy(0.1)  # the alarm would have fired here
    except Abandon:
        pytest.fail("a stop already taken was raised again")
    assert pre.stop_requested
