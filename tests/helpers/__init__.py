"""Code the tests (and the benchmarks' baselines) share: tiny models, oracles, Lightning fixtures, stream checks."""
