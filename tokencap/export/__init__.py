"""Exports of a run's rows as training data: `exporter` drives them, the sinks write each format."""
