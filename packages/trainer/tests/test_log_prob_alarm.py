"""The log-prob alarm warns once: above its threshold in default numerics; at any gap of the
tokens the step's weights sampled under numerics=exact (stale async tokens do not count)."""

from drivetrain.trainer.rl.log_prob_alarm import LogProbAlarm


def run(alarm: LogProbAlarm, steps: list[dict[str, float]]) -> None:
    for step, metrics in enumerate(steps, 1):
        alarm.check(step, metrics)


def test_default_numerics_warn_above_the_threshold_once():
    said: list[str] = []
    run(LogProbAlarm(0.002, said.append), [{"actor/rollout_log_prob_diff": 1e-7}] + [
        {"actor/rollout_log_prob_diff": 0.01}] * 2)  # fmt: skip
    assert len(said) == 1 and said[0].startswith("warning: step 2:")


def test_exact_numerics_warn_at_any_gap_of_current_tokens():
    said: list[str] = []
    alarm = LogProbAlarm(0.002, said.append, exact=True)
    stale_only = {"actor/current_weights_log_prob_diff_max": 0.0,
                  "actor/rollout_log_prob_diff_max": 0.5}  # fmt: skip
    run(alarm, [stale_only, {"actor/rollout_log_prob_diff_max": 0.0}])
    assert said == []
    alarm.check(3, {"rollout/log_prob_diff_max": 2e-8, "actor/rollout_log_prob_diff_max": 0.3})
    alarm.check(4, {"actor/rollout_log_prob_diff_max": 1.0})
    assert len(said) == 1 and "numerics=exact, but rollout/log_prob_diff_max is 2e-08" in said[0]
    off = LogProbAlarm(-1, said.append, exact=True)
    off.check(1, {"actor/rollout_log_prob_diff_max": 1.0})
    assert len(said) == 1
