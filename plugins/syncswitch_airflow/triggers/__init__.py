"""Triggers: async waits that run on the Airflow triggerer."""
