"""What runs on every training rank: the loop, its step, its device, its data feed and its guards."""
