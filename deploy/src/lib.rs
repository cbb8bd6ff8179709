//! provledger-deploy owns the deployment artefacts: the nats-server configurations for one
//! machine and for a JetStream cluster (in `deploy/nats/`), who may write what
//! (`deploy/nats/accounts.conf`), TLS (`deploy/nats/tls.conf`, `deploy/tls/make-test-ca.sh`),
//! the systemd units and the compose file, and the code that renders the configurations.
//! The test harness renders the same files, so what is deployed is what is tested.
//!
//! It never starts processes or talks to NATS; rendering is pure.

use std::path::Path;

const SINGLE: &str = include_str!("../nats/single.conf");
const CLUSTER_NODE: &str = include_str!("../nats/cluster-node.conf");
const ACCOUNTS: &str = include_str!("../nats/accounts.conf");
const TLS: &str = include_str!("../nats/tls.conf");

/// The users of `accounts.conf`, each with the environment variable nats-server reads its
/// password from: (account, user, variable).
pub const ACCOUNT_USERS: [(&str, &str, &str); 7] = [
    ("LEDGER", "serve", "PROVLEDGER_SERVE_PASSWORD"),
    ("LEDGER", "writer", "PROVLEDGER_WRITER_PASSWORD"),
    ("LEDGER", "auditor", "PROVLEDGER_AUDITOR_PASSWORD"),
    ("LEDGER", "executor-compute", "PROVLEDGER_EXECUTOR_PASSWORD"),
    ("SERVICES", "worker-w1", "PROVLEDGER_WORKER_PASSWORD"),
    ("SERVICES", "provisioner", "PROVLEDGER_SERVICE_PASSWORD"),
    ("SERVICES", "reader", "PROVLEDGER_READER_PASSWORD"),
];

/// What is added to a plain configuration: the accounts and permissions, and TLS with
/// verified client certificates from the files in `tls_dir` (as make-test-ca.sh names them).
#[derive(Debug, Clone, Default)]
pub struct Hardening {
    pub accounts: bool,
    pub tls_dir: Option<std::path::PathBuf>,
}

impl Hardening {
    fn render(&self) -> String {
        let mut out = String::new();
        if let Some(dir) = &self.tls_dir {
            out.push('\n');
            out.push_str(&TLS.replace("{{tls_dir}}", &dir.display().to_string()));
        }
        if self.accounts {
            out.push('\n');
            out.push_str(ACCOUNTS);
        }
        out
    }
}

/// Ports and paths for one server.
#[derive(Debug, Clone)]
pub struct ServerSpec {
    pub name: String,
    pub host: String,
    pub port: u16,
    pub monitor_port: u16,
    pub cluster_port: u16,
}

fn fill(template: &str, spec: &ServerSpec, store_dir: &Path) -> String {
    template
        .replace("{{name}}", &spec.name)
        .replace("{{host}}", &spec.host)
        .replace("{{port}}", &spec.port.to_string())
        .replace("{{monitor_port}}", &spec.monitor_port.to_string())
        .replace("{{cluster_port}}", &spec.cluster_port.to_string())
        .replace("{{store_dir}}", &store_dir.display().to_string())
}

/// `config` with the value of each top-level or block setting `key` replaced, keeping the
/// line's indentation. `deploy/nats/single.conf` is a configuration that runs as is, not a
/// template, so rendering rewrites its settings rather than filling placeholders.
///
/// Each key must be set on exactly one line: a key not found would leave the default (a
/// test server on the standard port), so that is a bug in the file, asserted here.
fn set_values(config: &str, values: &[(&str, String)]) -> String {
    let mut found = vec![0usize; values.len()];
    let mut out = String::with_capacity(config.len());
    for line in config.lines() {
        let setting = line.trim_start();
        let indent = &line[..line.len() - setting.len()];
        let key_of_line = values.iter().position(|(key, _)| {
            setting
                .strip_prefix(key)
                .is_some_and(|rest| rest.starts_with(':'))
        });
        match key_of_line {
            Some(i) => {
                found[i] += 1;
                let (key, value) = &values[i];
                out.push_str(&format!("{indent}{key}: {value}"));
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    for ((key, _), count) in values.iter().zip(&found) {
        assert_eq!(
            *count, 1,
            "`{key}:` must be set on exactly one line of the configuration"
        );
    }
    out
}

/// The configuration of a single JetStream server: `deploy/nats/single.conf` with the
/// server's name, ports and store, plus the hardening.
pub fn single_node_config(spec: &ServerSpec, store_dir: &Path, hardening: &Hardening) -> String {
    let values = [
        ("server_name", spec.name.clone()),
        ("listen", format!("{}:{}", spec.host, spec.port)),
        ("http", format!("{}:{}", spec.host, spec.monitor_port)),
        ("store_dir", format!("\"{}\"", store_dir.display())),
    ];
    set_values(SINGLE, &values) + &hardening.render()
}

/// Where `deploy/nats/single.conf` is in the source tree, for running it as is.
pub fn single_node_config_path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("nats/single.conf")
}

/// One configuration per cluster member; each routes to all the others.
pub fn cluster_configs(
    specs: &[ServerSpec],
    store_dirs: &[&Path],
    hardening: &Hardening,
) -> Vec<String> {
    specs
        .iter()
        .zip(store_dirs)
        .map(|(spec, dir)| {
            let routes: Vec<String> = specs
                .iter()
                .filter(|other| other.name != spec.name)
                .map(|other| format!("    nats-route://{}:{}", other.host, other.cluster_port))
                .collect();
            fill(CLUSTER_NODE, spec, dir).replace("{{routes}}", &routes.join("\n"))
                + &hardening.render()
        })
        .collect()
}

/// The three members of `deploy/compose/compose.yaml`: hosts `nats-1`..`nats-3` (the
/// compose service names), standard ports, the store in the container's `/data`, with
/// the accounts. `deploy/compose/nats-N.conf` are these, committed (a test keeps them equal).
pub fn compose_configs() -> Vec<String> {
    let specs: Vec<ServerSpec> = (1..=3)
        .map(|n| ServerSpec {
            name: format!("nats-{n}"),
            host: format!("nats-{n}"),
            port: 4222,
            monitor_port: 8222,
            cluster_port: 6222,
        })
        .collect();
    let store = Path::new("/data/jetstream");
    let hardening = Hardening {
        accounts: true,
        tls_dir: None,
    };
    cluster_configs(&specs, &[store, store, store], &hardening)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(n: u16) -> ServerSpec {
        ServerSpec {
            name: format!("n{n}"),
            host: "127.0.0.1".into(),
            port: 4000 + n,
            monitor_port: 8000 + n,
            cluster_port: 6000 + n,
        }
    }

    #[test]
    fn single_node_config_has_no_placeholder_left() {
        let c = single_node_config(&spec(1), Path::new("/tmp/x"), &Hardening::default());
        assert!(!c.contains("{{"), "{c}");
        assert!(c.contains("listen: 127.0.0.1:4001"));
        assert!(c.contains("store_dir: \"/tmp/x\""));
    }

    #[test]
    fn rendering_single_conf_rewrites_every_default_the_committed_file_runs_with() {
        // Given: the committed file, which runs as is on the standard ports.
        assert!(!SINGLE.contains("{{"), "single.conf is not a template");
        assert!(SINGLE.contains("listen: 127.0.0.1:4222"));
        // When: it is rendered for a server of its own.
        let c = single_node_config(&spec(1), Path::new("/tmp/x"), &Hardening::default());
        // Then: none of the defaults is left in a setting, the rest of the file is.
        let settings: Vec<&str> = c
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect();
        for default in ["provledger-nats", ":4222", ":8222", "\"nats-data\""] {
            assert!(
                !settings.iter().any(|l| l.contains(default)),
                "{default} left in:\n{c}"
            );
        }
        assert!(c.contains("server_name: n1"));
        assert!(c.contains("http: 127.0.0.1:8001"));
        assert!(c.contains("  max_file_store: 64GB"));
        assert_eq!(c.lines().count(), SINGLE.lines().count());
    }

    #[test]
    #[should_panic(expected = "`listen:` must be set on exactly one line")]
    fn rendering_refuses_a_configuration_without_a_setting_it_must_rewrite() {
        set_values("port: 4222\n", &[("listen", "127.0.0.1:1".into())]);
    }

    #[test]
    fn each_cluster_member_routes_to_the_others_only() {
        let specs = [spec(1), spec(2), spec(3)];
        let dirs = [Path::new("/a"), Path::new("/b"), Path::new("/c")];
        let configs = cluster_configs(&specs, &dirs, &Hardening::default());
        assert_eq!(configs.len(), 3);
        assert!(
            !configs[0].contains("nats-route://127.0.0.1:6001"),
            "no route to itself"
        );
        assert!(configs[0].contains("nats-route://127.0.0.1:6002"));
        assert!(configs[0].contains("nats-route://127.0.0.1:6003"));
        assert!(!configs[1].contains("{{"));
    }

    #[test]
    fn the_committed_compose_configs_are_the_rendered_ones() {
        let committed = [
            include_str!("../compose/nats-1.conf"),
            include_str!("../compose/nats-2.conf"),
            include_str!("../compose/nats-3.conf"),
        ];
        for (n, (rendered, committed)) in compose_configs().iter().zip(committed).enumerate() {
            assert_eq!(
                rendered,
                committed,
                "deploy/compose/nats-{}.conf is stale: regenerate it with \
                 `cargo run -p provledger-deploy --example render-compose`",
                n + 1
            );
        }
    }

    #[test]
    fn hardening_adds_tls_and_every_account_user_with_its_password_variable() {
        let hardening = Hardening {
            accounts: true,
            tls_dir: Some("/etc/provledger/tls".into()),
        };
        let c = single_node_config(&spec(1), Path::new("/tmp/x"), &hardening);
        assert!(!c.contains("{{"), "{c}");
        assert!(c.contains("cert_file: \"/etc/provledger/tls/server.pem\""));
        assert!(c.contains("verify: true"));
        for (_, user, variable) in ACCOUNT_USERS {
            assert!(
                c.contains(&format!("user: {user}, password: ${variable}")),
                "{user}"
            );
        }
    }
}
