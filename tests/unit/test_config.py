import pytest

from cascade.config import ConfigError, cascade_home
from edge_agent.config import EdgeConfig


def test_defaults_without_file_or_environment():
    c = EdgeConfig.load(environ={})
    assert c.server.port == 8081
    assert c.server.host == "127.0.0.1"
    assert c.model.name == "qwen2.5-coder-0.5b"  # the edge of the default tier pair
    assert c.upstream.url == ""


def test_file_then_environment_then_flags(tmp_path):
    f = tmp_path / "edge.toml"
    f.write_text('[server]\nport = 9000\napi_key = "from-file"\n[model]\nn_ctx = 1024\n'
                 '[upstream]\nurl = "http://file"\n')
    env = {"CASCADE_EDGE_UPSTREAM_URL": "http://env", "CASCADE_EDGE_MODEL_N_CTX": "512",
           "CASCADE_EDGE_SERVER_PORT": "9100", "CASCADE_CLOUD_SERVER_PORT": "1"}
    c = EdgeConfig.load(f, overrides={"server": {"port": 9200, "api_key": None}}, environ=env)
    assert c.server.port == 9200  # flag beats environment beats file
    assert c.server.api_key == "from-file"  # a flag left unset changes nothing
    assert c.model.n_ctx == 512
    assert c.upstream.url == "http://env"


def test_environment_values_are_typed():
    env = {"CASCADE_EDGE_MODEL_SEARCH_PATHS": "/a,/b", "CASCADE_EDGE_UPSTREAM_TIMEOUT_S": "2.5",
           "CASCADE_EDGE_MODEL_PARALLEL": "3"}
    c = EdgeConfig.load(environ=env)
    assert [str(p) for p in c.model.search_paths] == ["/a", "/b"]
    assert c.upstream.timeout_s == 2.5
    assert c.model.parallel == 3


@pytest.mark.parametrize("env, match", [
    ({"CASCADE_EDGE_SERVER_PORT": "eighty"}, r"^CASCADE_EDGE_SERVER_PORT \(server.port\): expected int"),
    ({"CASCADE_EDGE_MODEL_PARALLEL": "0"}, r"^CASCADE_EDGE_MODEL_PARALLEL=0: \[model\] parallel"),
    ({"CASCADE_EDGE_SERVER_PORT": "70000"}, r"^CASCADE_EDGE_SERVER_PORT=70000: \[server\] port"),
])
def test_bad_values_from_the_environment_are_refused_naming_the_variable(env, match):
    """Issue 37 item 17: the variable is named, not only the key it sets."""
    with pytest.raises(ConfigError, match=match):
        EdgeConfig.load(environ=env)


def test_a_bad_value_a_flag_replaced_or_a_file_gave_names_no_variable(tmp_path):
    f = tmp_path / "edge.toml"
    f.write_text("[model]\nparallel = 0\n")
    with pytest.raises(ConfigError, match=r"^\[model\]: parallel"):
        EdgeConfig.load(f, environ={})
    with pytest.raises(ConfigError, match=r"^\[server\]: port"):
        EdgeConfig.load(overrides={"server": {"port": 70000}}, environ={"CASCADE_EDGE_SERVER_PORT": "1"})


def test_unknown_section_or_key_in_file_is_an_error(tmp_path):
    f = tmp_path / "edge.toml"
    f.write_text("[server]\nprot = 1\n")
    with pytest.raises(ConfigError, match="prot"):
        EdgeConfig.load(f, environ={})
    f.write_text("[sever]\nport = 1\n")
    with pytest.raises(ConfigError, match="sever"):
        EdgeConfig.load(f, environ={})


def test_missing_or_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        EdgeConfig.load(tmp_path / "nope.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\n")
    with pytest.raises(ConfigError, match="TOML"):
        EdgeConfig.load(bad, environ={})


def test_cascade_home_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CASCADE_HOME", str(tmp_path))
    assert cascade_home() == tmp_path
    monkeypatch.delenv("CASCADE_HOME")
    assert cascade_home().name == ".cascade"


def test_an_unknown_environment_variable_is_named_in_a_warning(caplog):
    """issue 12, item 11: a typo in CASCADE_EDGE_* was silently ignored."""
    env = {"CASCADE_EDGE_CASCADE_MODEE": "cloud", "CASCADE_EDGE_SERVR_PORT": "1", "CASCADE_EDGE_SERVER_PORT": "9100",
           "CASCADE_CLOUD_SERVER_PORT": "1"}  # another deployable's variable is not this one's business
    with caplog.at_level("WARNING", logger="cascade.config"):
        c = EdgeConfig.load(environ=env)
    assert c.server.port == 9100 and c.cascade.mode == "auto"
    text = caplog.text
    assert "CASCADE_EDGE_CASCADE_MODEE" in text and "'modee'" in text
    assert "CASCADE_EDGE_SERVR_PORT" in text and "CASCADE_CLOUD_SERVER_PORT" not in text
    assert len(caplog.records) == 2  # the known variable is not warned about
