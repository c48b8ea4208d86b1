//! `delay-bridge permissions`: the least-privilege recipe for the configured prefix and
//! routes, as `rabbitmqctl set_permissions` commands, one per role.

use delay_bridge::config::Config;
use delay_bridge::permissions::grants;

/// The recipe as text: per role a comment saying what it does, then its command. The
/// bridge's user is the configured URL's; the other roles' users are named after them.
pub fn render(config: &Config) -> String {
    let (bridge_user, _, vhost) = config.url().credentials_and_vhost();
    let mut out = format!(
        "# Least-privilege permissions on virtual host {vhost} for prefix `{}` \
         (docs/operations.md, \"Permissions\"). Replace the user names with yours.\n",
        config.names.prefix()
    );
    for grant in grants(config) {
        let user = if grant.role == "bridge" {
            bridge_user.clone()
        } else {
            grant.role.to_string()
        };
        out.push_str(&format!(
            "\n# {}: {}\n{}\n",
            grant.role,
            grant.purpose,
            grant.command(&vhost, &user)
        ));
    }
    out
}
