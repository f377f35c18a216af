"""The MQTT control plane: topics and clients (`bus`), and send limits set while a run goes on
(`link_control`)."""
