//! provledger-deploy owns the deployment artefacts: the nats-server configurations for one
//! machine and for a JetStream cluster (in `deploy/nats/`), and the code that renders them.
//! The test harness renders the same files, so what is deployed is what is tested.
//!
//! It never starts processes or talks to NATS; rendering is pure.

use std::path::Path;

const SINGLE: &str = include_str!("../nats/single.conf");
const CLUSTER_NODE: &str = include_str!("../nats/cluster-node.conf");

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

/// The configuration of a single JetStream server.
pub fn single_node_config(spec: &ServerSpec, store_dir: &Path) -> String {
    fill(SINGLE, spec, store_dir)
}

/// One configuration per cluster member; each routes to all the others.
pub fn cluster_configs(specs: &[ServerSpec], store_dirs: &[&Path]) -> Vec<String> {
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
        })
        .collect()
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
        let c = single_node_config(&spec(1), Path::new("/tmp/x"));
        assert!(!c.contains("{{"), "{c}");
        assert!(c.contains("listen: 127.0.0.1:4001"));
        assert!(c.contains("store_dir: \"/tmp/x\""));
    }

    #[test]
    fn each_cluster_member_routes_to_the_others_only() {
        let specs = [spec(1), spec(2), spec(3)];
        let dirs = [Path::new("/a"), Path::new("/b"), Path::new("/c")];
        let configs = cluster_configs(&specs, &dirs);
        assert_eq!(configs.len(), 3);
        assert!(
            !configs[0].contains("nats-route://127.0.0.1:6001"),
            "no route to itself"
        );
        assert!(configs[0].contains("nats-route://127.0.0.1:6002"));
        assert!(configs[0].contains("nats-route://127.0.0.1:6003"));
        assert!(!configs[1].contains("{{"));
    }
}
