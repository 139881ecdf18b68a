"""`spillpack pack`: a job turned into one directory that runs anywhere with ./run.sh (ARCHITECTURE.md, The bundle)."""
