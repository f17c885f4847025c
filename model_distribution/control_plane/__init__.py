"""``cascade fleet serve``: the HTTP API, the MQTT broker and the desired-state publisher."""
