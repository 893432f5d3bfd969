"""Vertex AI's prediction protocol: the AIP_* variables, a child's environment, a /predict body's model."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.errors import ApiError, ConfigError
from rolemesh.config.file import validate
from rolemesh.config.vertex_ai import VertexAI, child_environment, from_environ, predict_model


class EnvironmentTests(SynchronousTestCase):
    def test_outside_vertex_ai_nothing_changes(self) -> None:
        self.assertIsNone(from_environ({}))
        self.assertIsNone(from_environ({"AIP_MODE": "TRAINING", "AIP_HTTP_PORT": "9"}))
        self.assertEqual(validate({"listen_port": 9000}, check_files=False, environ={}).listen_port, 9000)

    def test_the_platforms_port_is_where_the_agent_listens(self) -> None:
        env = {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "7080", "AIP_PREDICT_ROUTE": "predict",
               "AIP_HEALTH_ROUTE": "/health"}
        self.assertEqual(from_environ(env), VertexAI(http_port=7080))
        self.assertEqual(from_environ({"AIP_MODE": "PREDICTION"}), VertexAI(http_port=8080))  # the platform's default
        config = validate({"listen_port": 9000}, check_files=False, environ=env)
        self.assertEqual((config.listen_port, config.advertise_url.rsplit(":", 1)[1]), (7080, "7080"))

    def test_what_the_agent_cannot_do_is_one_clear_line(self) -> None:
        for env, message in (
            ({"AIP_HTTP_PORT": "http"}, "AIP_HTTP_PORT: expected a port number 1-65535, got 'http'"),
            ({"AIP_PREDICT_ROUTE": "/v1/endpoints/1/deployedModels/2:predict"},
             "AIP_PREDICT_ROUTE: the agent serves /predict, not '/v1/endpoints/1/deployedModels/2:predict'; "
             "set the container's predictRoute to /predict"),
            ({"AIP_HEALTH_ROUTE": "/healthz"},
             "AIP_HEALTH_ROUTE: the agent serves /health, not '/healthz'; set the container's healthRoute to /health"),
        ):
            with self.assertRaises(ConfigError) as caught:
                from_environ({"AIP_MODE": "PREDICTION", **env})
            self.assertEqual(str(caught.exception), message)

    def test_a_child_never_gets_the_parents_port(self) -> None:
        parent = {"PATH": "/bin", "AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "8080", "AIP_HEALTH_ROUTE": "/h",
                  "AIP_STORAGE_URI": "gs://x"}
        self.assertEqual(child_environment(parent, 20001), {
            "PATH": "/bin", "AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "20001", "AIP_PREDICT_ROUTE": "/predict"})


class PredictModelTests(SynchronousTestCase):
    def test_the_model_the_instances_share(self) -> None:
        self.assertEqual(predict_model({"instances": [{"model": "a"}, {"messages": []}, {"model": "a"}]}), "a")
        self.assertEqual(predict_model({"model": "a", "instances": [{}]}), "a")
        self.assertIsNone(predict_model({"instances": [{"@requestFormat": "chatCompletions"}]}))
        self.assertIsNone(predict_model({"instances": "not a list"}))  # the child's to refuse

    def test_two_models_or_a_bad_name_are_400(self) -> None:
        for payload, message in (
            ({"instances": [{"model": "b"}, {"model": "a"}]},
             "the instances of one /predict name different models (a, b); send one request per model"),
            ({"model": "a", "instances": [{"model": "b"}]},
             "the instances of one /predict name different models (a, b); send one request per model"),
            ({"instances": [{"model": {"x": 1}}]}, 'an instance\'s "model" must be a non-empty string'),
            ({"instances": [{"model": ""}]}, 'an instance\'s "model" must be a non-empty string'),
        ):
            with self.assertRaises(ApiError) as caught:
                predict_model(payload)
            self.assertEqual((caught.exception.status, caught.exception.code, caught.exception.message),
                             (400, "invalid_model", message))
