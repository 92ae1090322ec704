"""Measuring an artifact: held-out evaluation against baselines, metrics with bootstrap
intervals, the resplit simulation of the guarantee, the report, the demo and the live
deployment check."""
