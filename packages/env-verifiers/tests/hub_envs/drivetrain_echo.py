"""A tiny verifiers environment, written with verifiers' own classes as a hub author writes
one (``vf-init``'s layout in one module): the task asks for a word, the reward says whether the
agent's last reply holds it. ``taskset.task.score=length`` scores the reply's length instead
(up to 16 characters: 1), which an untrained model's replies vary in. The tests import it in the
verifiers environment only (``episode.options.pythonpath``)."""

import verifiers.v1 as vf

WORDS = {"train": ["apple", "pear", "plum", "fig", "kiwi", "lime"], "val": ["date", "yuzu"]}


class EchoData(vf.TaskData):
    word: str = ""


class EchoTaskConfig(vf.TaskConfig):
    score: str = "word"


class EchoTask(vf.Task[EchoData, vf.State, EchoTaskConfig]):
    @vf.reward(weight=1.0)
    async def said_it(self, trace: vf.Trace) -> float:
        reply = trace.last_reply
        if self.config.score == "length":
            return min(len(reply), 16) / 16
        return 1.0 if self.data.word in reply else 0.0


class EchoConfig(vf.TasksetConfig):
    split: str = "train"
    task: EchoTaskConfig = EchoTaskConfig()


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self) -> list[EchoTask]:
        return [
            EchoTask(EchoData(prompt=f"Say {word}.", word=word), self.config.task)
            for word in WORDS[self.config.split]
        ]


__all__ = ["EchoTaskset"]
