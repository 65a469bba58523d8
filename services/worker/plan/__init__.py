"""`inferno plan`: how a model's memory falls on each GPU of a layout, computed before any load."""
