"""Offline tools over prefixgate logs and public traces.

``prefixgate analyze PATH…`` (or ``python -m analyzers PATH…``) reads request logs and traces,
replays them through an unbounded prefix cache and a capacity-bounded LRU, and explains where
caching was lost and what would win it back. The rooms:

- ``inputs``: files as they lie on disk (gzip or xz, directories of logs);
- ``readers``: input formats (prefixgate records, OpenAI request bodies, Mooncake and
  kv-cache-tester traces) turned into one stream of ``TraceRequest``;
- ``ideal``: the unbounded-cache replay (ideal vs measured hit rate, hit rate over time);
- ``capacity``: LRU simulation over prefix blocks (hit rate vs cache size);
- ``prefixtree``: the largest groups of requests sharing a prefix;
- ``breakers`` and ``spans``: where requests of one application prompt diverge, and why;
- ``providers`` and ``goodput``: provider caching rules, SLO attainment and latency;
- ``quantile``: the one percentile definition (nearest rank), shared with the benchmarks;
- ``analysis``: runs all of the above; ``report``, ``html`` and ``svg`` present it;
- ``cli``: the command line.
"""

from analyzers.analysis import Analysis, AnalyzeOptions, analyze

__all__ = ["Analysis", "AnalyzeOptions", "analyze"]
