//! Writes deploy/compose/nats-{1,2,3}.conf from the templates (after changing them).
//! Usage: cargo run -p provledger-deploy --example render-compose

fn main() -> std::io::Result<()> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("compose");
    for (n, config) in provledger_deploy::compose_configs().iter().enumerate() {
        let path = dir.join(format!("nats-{}.conf", n + 1));
        std::fs::write(&path, config)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
