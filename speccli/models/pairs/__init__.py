"""Which draft goes with which target: compatibility, the draft `--draft auto` takes, and
published heads."""
