"""``cascade calibrate``: the escalation thresholds chosen from both tiers' answers to a prompt set."""
