"""One module per job command; they share the job core in runtime.core.job."""
