"""The embedded MQTT broker (amqtt) that ``FleetBroker`` runs when no Mosquitto is installed: a
thread of its own with its own event loop, inside the control plane's process.

It takes the same credentials and enforces the same ACL as Mosquitto with the files from
``mosquitto_files.broker_files`` (``broker_acl.allowed`` is that rule): each CONNECT is checked against the
DeviceStore, so a device enrolled after the start connects at once. Retained messages are kept in
SQLite as well as in memory, so the retained desired state survives a restart of the broker.

amqtt 0.12 sends a connecting client the retained messages of every filter that *any* client
subscribed to, and replays a persistent session's queued messages without asking the ACL;
``_FleetAMQTT`` overrides those two steps to deliver only what the session may read (Mosquitto
checks reads at delivery too). It also looked up (and took over, or deleted) the session of the
client id a CONNECT named before it checked the credentials, so anyone who could reach the port
could disconnect the control plane or a device by naming its client id; here the CONNECT is
checked first, a refused one touches no session, and an accepted client's id is its user name
(as Mosquitto's ``use_username_as_clientid``, which ``broker.py`` sets): an identity has one
session, which only its own credentials reach.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sqlite3
import threading
from pathlib import Path

from amqtt.broker import Broker, RetainedApplicationMessage
from amqtt.contexts import Action
from amqtt.errors import AMQTTError, MQTTError, NoDataError
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.session import Session
from amqtt.utils import gen_client_id

from model_distribution.control_plane.broker_acl import MAX_PACKET_BYTES
from model_distribution.control_plane.embedded_access import BoundedReader, FleetAccessPlugin
from model_distribution.fleet.devices import DeviceStore
from sync.sqlite import connect

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0  # a connection must log in within this
MAX_PENDING_PER_ADDRESS = 32  # connections from one address not yet logged in
FD_RESERVE = 256  # file descriptors the control plane keeps for itself (HTTP, databases, files)


class _FleetAMQTT(Broker):
    """amqtt's broker with retained messages kept in SQLite, reads always asked of the ACL, and
    CONNECTs checked before any session is touched (see the module docstring)."""

    def __init__(self, config: dict, retained: sqlite3.Connection, max_connections: int):
        super().__init__(config)
        self._db = retained
        self._verdicts: dict[int, bool] = {}  # id(session) -> its CONNECT's credentials held
        self.max_connections = max_connections
        self._live = 0
        self._pending: dict[str, int] = {}  # address -> its connections that have not logged in yet
        self._pending_of: dict[int, str] = {}  # id(reader) -> its address, until it logs in

    def _is_device(self, user: str) -> bool:
        plugin = next((p for p in self.plugins_manager.plugins if isinstance(p, FleetAccessPlugin)), None)
        return plugin is None or user != plugin.user

    async def _client_connected(self, listener_name: str, reader, writer) -> None:
        """A connection: refused at once past MAX_CONNECTIONS, or past MAX_PENDING_PER_ADDRESS from
        one address still to send its CONNECT (which must come within CONNECT_TIMEOUT_S); closed
        whatever amqtt left of it when it ends (it left a socket open after a failed CONNECT)."""
        address = (writer.get_peer_info() or ("?", 0))[0]
        if self._live >= self.max_connections or self._pending.get(address, 0) >= MAX_PENDING_PER_ADDRESS:
            log.warning("refused a connection from %s: %d open, %d from it not yet logged in", address, self._live,
                        self._pending.get(address, 0))
            await _close(writer)
            return
        self._live += 1
        self._pending[address] = self._pending.get(address, 0) + 1
        self._pending_of[id(reader)] = address
        try:
            await super()._client_connected(listener_name, BoundedReader(reader, self._logged_in, id(reader)),
                                            writer)
        finally:
            self._live -= 1
            self._logged_in(id(reader))
            await _close(writer)

    def _logged_in(self, key: int) -> None:
        address = self._pending_of.pop(key, None)
        if address is not None:
            left = self._pending.get(address, 1) - 1
            if left > 0:
                self._pending[address] = left
            else:
                self._pending.pop(address, None)

    async def _authenticate(self, session: Session, listener) -> bool:
        verdict = self._verdicts.pop(id(session), None)  # checked once, in _initialize_client_session
        return verdict if verdict is not None else await super()._authenticate(session, listener)

    async def _initialize_client_session(self, reader, writer, remote_address, remote_port):
        """amqtt 0.12's, but the CONNECT's credentials are checked before a session is looked up,
        an accepted client's id is its user name, and a refused one gets a fresh id of its own."""
        try:
            handler, client_session = await asyncio.wait_for(
                BrokerProtocolHandler.init_from_connect(reader, writer, self.plugins_manager), CONNECT_TIMEOUT_S)
        except TimeoutError as exc:  # a socket that never sends its CONNECT holds a file descriptor
            raise AMQTTError(f"no CONNECT from {remote_address}:{remote_port} in {CONNECT_TIMEOUT_S:.0f} s") from exc
        except AMQTTError as exc:
            self.logger.warning(f"can't read the first packet of {remote_address}:{remote_port} as CONNECT: {exc}")
            raise AMQTTError(exc) from exc
        except MQTTError as exc:
            self.logger.warning(f"invalid connection from {remote_address}:{remote_port}")
            await writer.close()
            raise MQTTError(exc) from exc
        except NoDataError as exc:
            raise AMQTTError(exc) from exc
        if isinstance(reader, BoundedReader):
            reader.logged_in()  # it sent its CONNECT: no longer pending for its address
        ok = await super()._authenticate(client_session, None)
        if ok:
            client_session.client_id = client_session.username  # one identity, one session
            if isinstance(reader, BoundedReader) and not self._is_device(client_session.username):
                reader.unpaced()  # the control plane: a fleet's desired documents at each reconnect
        else:  # refused below (CONNACK 5): it must not reach the session of the id it named
            client_session.client_id = f"refused-{secrets.token_hex(8)}"
            client_session.clean_session = True
        if client_session.clean_session:
            if client_session.client_id:
                await self._delete_session(client_session.client_id)
            else:
                client_session.client_id = gen_client_id()
            client_session.parent = 0
        elif client_session.client_id in self._sessions:
            existing, _ = self._sessions[client_session.client_id]
            for name in ("will_flag", "will_message", "will_topic", "will_qos", "keep_alive", "username", "password"):
                setattr(existing, name, getattr(client_session, name))
            client_session = existing
            client_session.parent = 1
        else:
            client_session.parent = 0
        delay = self.config.get("timeout-disconnect-delay", 0)
        if client_session.keep_alive > 0 and isinstance(delay, int):
            client_session.keep_alive += delay
        self._verdicts[id(client_session)] = ok
        return handler, client_session

    async def _handle_client_session(self, reader, writer, client_session: Session, handler, server,
                                     listener_name: str) -> None:
        try:
            await super()._handle_client_session(reader, writer, client_session, handler, server, listener_name)
        finally:
            self._verdicts.pop(id(client_session), None)
            if client_session.client_id.startswith("refused-"):  # amqtt keeps even a refused session: not here
                self._sessions.pop(client_session.client_id, None)

    async def start(self) -> None:
        await super().start()  # it starts with no retained messages; put back the stored ones
        self._db.execute("DELETE FROM retained WHERE length(payload) > ?", (MAX_PACKET_BYTES,))  # kept before the bound
        for topic, data, qos in self._db.execute("SELECT topic, payload, qos FROM retained"):
            self.retained_messages[topic] = RetainedApplicationMessage(None, topic, data, qos)

    async def retain_message(self, source_session, topic_name, data, qos=None) -> None:
        await super().retain_message(source_session, topic_name, data, qos)
        if topic_name is None:
            return
        if data:
            self._db.execute("INSERT OR REPLACE INTO retained (topic, payload, qos) VALUES (?, ?, ?)",
                             (topic_name, bytes(data), qos or 0))
        else:  # an empty retained message clears the topic
            self._db.execute("DELETE FROM retained WHERE topic = ?", (topic_name,))

    async def _may_receive(self, session: Session, topic: str) -> bool:
        return await self._topic_filtering(session, topic, Action.RECEIVE)

    async def _publish_retained_messages_for_subscription(self, subscription, session: Session) -> None:
        topic_filter, qos = subscription
        if all(s.client_id != session.client_id for s, _ in self.subscriptions.get(topic_filter, [])):
            return  # another client's filter (amqtt walks them all when a session connects)
        handler = self._get_handler(session)
        if handler is None:
            return
        sends = [asyncio.ensure_future(handler.mqtt_publish(m.topic, m.data, min(qos, m.qos or qos), retain=True))
                 for topic, m in list(self.retained_messages.items())
                 if self._matches(topic, topic_filter) and await self._may_receive(session, topic)]
        if sends:
            await asyncio.wait(sends)

    async def _publish_session_retained_messages(self, session: Session) -> None:
        handler = self._get_handler(session)
        sends = []
        while handler is not None and not session.retained_messages.empty():
            m = await session.retained_messages.get()
            if await self._may_receive(session, m.topic):  # queued for this client id, maybe another user's
                sends.append(asyncio.ensure_future(handler.mqtt_publish(m.topic, m.data, m.qos, retain=True)))
        if sends:
            await asyncio.wait(sends)


class EmbeddedBroker:
    """amqtt on ``host:port`` (port 0: the OS picks), on a thread of its own. ``start()`` returns
    the port it listens on once it accepts connections; ``stop()`` closes every connection."""

    def __init__(self, store: DeviceStore, host: str, port: int, control_plane: tuple[str, str], retained_db: Path,
                 tls=None):
        self.store, self.host, self.port = store, host, port
        self.tls = tls  # broker.TLSListener, or None
        self.control_plane = control_plane
        self._db = connect(retained_db, timeout_s=5.0)
        self._db.execute("CREATE TABLE IF NOT EXISTS retained (topic TEXT PRIMARY KEY, payload BLOB NOT NULL, "
                         "qos INTEGER NOT NULL)")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="embedded-mqtt-broker", daemon=True)
        self._broker: _FleetAMQTT | None = None

    def start(self) -> int:
        for name in ("amqtt", "transitions"):  # they log every connection and state change at INFO
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        self._thread.start()
        try:
            self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        except BaseException:
            self.stop()
            raise
        return self.port

    async def _start(self) -> int:
        listeners = {"default": {"type": "tcp", "bind": _bind(self.host, self.port)}}
        if self.tls is not None:
            listeners["tls"] = {"type": "tcp", "bind": _bind(self.tls.host, self.tls.port), "ssl": True,
                                "certfile": str(self.tls.certfile), "keyfile": str(self.tls.keyfile)}
        config = {"listeners": listeners,
                  "plugins": {f"{FleetAccessPlugin.__module__}.FleetAccessPlugin": {"store": self.store,
                                                                  "control_plane": self.control_plane}}}
        self._broker = _FleetAMQTT(config, self._db, connection_budget())
        await self._broker.start()
        return self._broker._servers["default"].instance.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._thread.is_alive():
            if self._broker is not None and self._broker.transitions.state == "started":
                asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop).result(timeout=30)
            asyncio.run_coroutine_threadsafe(self._loop.shutdown_default_executor(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_closed() and not self._loop.is_running():
            self._loop.close()
        self._db.close()


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _close(writer) -> None:
    try:
        await writer.close()
    except Exception:  # closed already, or the peer gone: nothing to give back
        pass


def connection_budget() -> int:
    """How many MQTT connections the embedded broker may hold: the process's file descriptors (its
    soft limit raised to the hard one) less FD_RESERVE, so no flood of connections takes the
    control plane's own (its HTTP side shares the process)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    limit = soft if soft != resource.RLIM_INFINITY else 65536
    return max(16, min(limit, 65536) - FD_RESERVE)
