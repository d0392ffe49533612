"""CallGate: a paused batch-call backend lets the running call finish and starts no new one."""

import threading

from drivetrain.rollout.call_gate import CallGate


def test_pause_waits_for_the_running_call_and_holds_new_ones():
    gate = CallGate()
    inside, release, paused, second_entered = (threading.Event() for _ in range(4))

    def first_call():
        with gate.call():
            inside.set()
            release.wait(10)

    def pauser():
        gate.pause()
        paused.set()

    def second_call():
        with gate.call():
            second_entered.set()

    first = threading.Thread(target=first_call)
    first.start()
    assert inside.wait(10)
    pausing = threading.Thread(target=pauser)
    pausing.start()
    assert not paused.wait(0.2)  # the running call holds the pause
    release.set()
    assert paused.wait(10)
    second = threading.Thread(target=second_call)
    second.start()
    assert not second_entered.wait(0.2)  # held while paused
    gate.resume()
    assert second_entered.wait(10)
    for t in (first, pausing, second):
        t.join(10)
