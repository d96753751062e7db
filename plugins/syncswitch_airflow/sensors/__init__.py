"""Sensors: deferrable watchers beside the pipeline's tasks."""
