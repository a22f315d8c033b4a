"""The bench room: ``headway bench`` (``run``: one process, interleaved methods; ``methods``: HF
baselines and headway; ``report``: table, JSON, plot) and ``headway tune`` (``tune``: measure
acceptance and forward costs, store the fastest tree with the heads). Settings in ``configs`` (light)."""
