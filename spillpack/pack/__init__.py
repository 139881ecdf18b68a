"""`spillpack pack`: a job turned into one directory that runs anywhere with ./run.sh (docs/bundle.md)."""
