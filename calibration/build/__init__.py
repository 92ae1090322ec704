"""Building an artifact: data sets, the built-in probe set, judges, the calibration pipeline
and its run cache. Runs once, offline, before the guard is deployed."""
