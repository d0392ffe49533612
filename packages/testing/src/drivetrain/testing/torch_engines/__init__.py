"""What testing a torch engine takes (the ``torch`` extra): ``ranks.launch_ranks`` runs a
worker script on N local ranks, forked from a ``zygote`` that imported the heavy modules once;
``kit_harness.TorchHarness`` is the torch half of a conformance-kit harness; ``kernels`` holds
a CPU reference of the packed-attention kernel contract."""
