"""LLaVA-1.5's evaluation benchmarks (POPE, TextVQA, ScienceQA, MME, MMBench, GQA, SEED-Bench, VQAv2, VizWiz) read in
the layout of LLaVA's evaluation guide, answered by a given batch answerer, scored by each official rule
(``docs/EVALUATION.md``). ``table.BENCHMARKS``: one row per benchmark; ``run.run_benchmark``: one end to end."""
