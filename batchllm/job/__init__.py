"""The batch job: an OpenAI-Batch file through an engine, crash-safe and resumable (batch_job.py),
its stop signals and progress bar."""
