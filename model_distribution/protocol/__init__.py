"""What the control plane and its devices agree on: typed device messages, topics, windows."""
