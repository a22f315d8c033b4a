"""``headway adapt``: heads that follow their target and the traffic they serve.

One adapt *round* distils the target's answers to new prompts, continues training the served heads
on them, measures tau before and after on a held-out slice of the same prompts with the decoder,
and publishes the new heads only when tau improves by the gate's threshold (docs/adapt.md). The
room sits above data, heads, train and decode (docs/design.md §2) and owns: the traffic reader
(``traffic``), the prompts of a round (``prompts``), the training settings derived from the served
heads (``training``), the gate's measurement (``measure``), the round's resumable state
(``state``, ``rounds``), the generations of published heads and rollback (``generations``), and the
watch loop (``watch``). ``configs`` holds the command's settings without importing torch.
"""
